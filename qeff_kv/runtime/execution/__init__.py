"""runtime/execution"""
