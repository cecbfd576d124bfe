"""Offline tools that turn model files into the Hugging Face folders tr_engine loads.

Each module is a command: `python -m weights_tools.<name> --help`.
"""
