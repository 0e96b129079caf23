"""Model definitions: `torch.nn.Module`s that map prepared inputs to hidden states and logits."""
