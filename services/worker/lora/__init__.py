"""LoRA adapters on the worker (docs/lora.md): PEFT checkpoints read and checked against the
model (`checkpoint`), the stacked per-slot weights on each projection (`weights`), which
adapter holds which slot (`slots`), and what a step needs of them (`manager`)."""
