"""sightline.engine"""
