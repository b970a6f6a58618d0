"""export/weights"""
