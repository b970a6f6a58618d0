"""serve/engine"""
