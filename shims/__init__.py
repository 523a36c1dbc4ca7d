"""Pure translation between wire formats and tensors, and the loss functions. No I/O, no Ray, no server state."""
