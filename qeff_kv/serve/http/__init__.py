"""serve/http"""
