"""sightline.instrumentation"""
