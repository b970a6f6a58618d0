"""export/facts"""
