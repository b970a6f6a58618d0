"""runtime/multimodal"""
