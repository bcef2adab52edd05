"""sightline.deploy"""
