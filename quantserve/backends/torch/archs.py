"""What the torch backend runs, readable without importing torch: the backend's plan reads it to choose, the model
and the weight loader to build.

ARCHITECTURES maps an HF `architectures` name to the family our Transformer implements (model.py); a LLaVA is its
language model's family behind a CLIP tower (llava.py). LOAD_QUANTS are the --quant values applied at load (RTN
W4A16, weights.py)."""

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MULTIMODAL = ("LlavaForConditionalGeneration",)
LOAD_QUANTS = ("int4",)
