"""Model loading, the target wrapper, the decoding engine and loop, and (later) the Gymnasium environments.

Importing ``env`` registers nothing heavy: model code loads on first use.
"""
