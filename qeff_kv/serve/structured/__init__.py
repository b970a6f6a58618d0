"""serve/structured"""
