"""sightline.dashboards"""
