"""The tiny config (examples/tiny/addition.yaml) and the facts config.resolve() takes about the model
(examples/tiny/model/config.json) and the machine (one CPU process): what the config tests resolve."""

TINY = "examples/tiny/addition.yaml"
FACTS = dict(
    world_size=1,
    local_world_size=1,
    num_heads=4,
    num_kv_heads=2,
    num_layers=3,
    ffn_hidden_size=512,
    num_train_records=1024,
    cuda=False,
    threads=2,
)
