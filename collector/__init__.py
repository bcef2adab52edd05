"""sightline.collector"""
