"""Standalone ``transformers`` remote-code model (configuration + modeling files) copied into exported Hugging Face
folders by :func:`checkpoint.hf.save_hf`, so ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``
loads softmax-with-options and Parallax exports. These files import nothing from this project."""
