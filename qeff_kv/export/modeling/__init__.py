"""export/modeling"""
