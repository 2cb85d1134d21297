"""Moving tokens between ranks, for the a2a backends.

- `collectives`: torch.distributed's functional collectives by group name, and the
  ops of namespace ``moe_collectives`` that stand for them in traced bodies.
- `communicators`: the one keyed cache of transport state a backend may keep.
- `quantized_dispatch`: fp8 dispatch (``dispatch_quant``) on any a2a backend's
  ``dispatch`` that moves rows as bytes.
- `token_routing`: the ids and weights that travel beside each token in the tokens format.
- `token_positions`: where the tokens format puts each token (token order), seen from the
  sender and from a receiver, and the sum of what comes home.
"""
