"""(in progress; see the issues)"""
