"""serve/cluster"""
