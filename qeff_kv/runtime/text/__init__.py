"""runtime/text"""
