"""runtime/decoding"""
