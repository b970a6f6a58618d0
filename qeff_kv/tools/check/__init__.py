"""tools/check"""
