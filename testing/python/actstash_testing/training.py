"""Training-step helpers: gradients, their bitwise comparison, and the model
and batches of the spill tier's test and benchmark (tests/python/test_spill.py,
bench/spill_step_bench.py)."""


def cloned_grads(model):
    """Copies of the parameters' gradients, in parameter order."""
    return [p.grad.clone() for p in model.parameters()]


def bitwise_equal(a, b):
    """Whether two lists of tensors are equal bit for bit, pair by pair."""
    import torch
    return all(torch.equal(x, y) for x, y in zip(a, b))


def assert_bitwise(expected, actual):
    """Asserts two lists of tensors equal bit for bit, naming the first that is not."""
    import torch
    assert len(expected) == len(actual), (len(expected), len(actual))
    for i, (a, b) in enumerate(zip(expected, actual)):
        assert torch.equal(a, b), f"gradient {i} differs (max |diff| {(a - b).abs().max()})"


def spill_gpt(GPT, layers=6):
    """examples/gpt.py's GPT (the class is passed in: examples/ is not a layer
    below this one) at the size whose activations, batch 8 x 256 tokens, are
    several times a 64 MiB pool: width 256, 4 heads, vocabulary 256, context
    256, no dropout; parameters from seed 0."""
    import torch
    torch.manual_seed(0)
    return GPT(vocab=256, dim=256, heads=4, layers=layers, context=256, dropout=0.0)


def spill_batch(step):
    """spill_gpt's batch of step `step`: 8 x 257 tokens from seed `step`."""
    import torch
    return torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(step))


def torch_version():
    """(major, minor) of the torch in use, e.g. (2, 6) for "2.6.0+debian"."""
    import torch
    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
