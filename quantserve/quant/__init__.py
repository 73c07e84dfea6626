"""Weight quantization shared by load time and conversion: round-to-nearest group quantization (rtn.py) and
dequantizing a quantized checkpoint back to dense safetensors (dequantize.py)."""
