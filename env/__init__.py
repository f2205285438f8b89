"""Model loading, the target wrapper, the decoding engine and loop, observation features, the cost model, traces
and replay, and the Gymnasium environments.

Importing ``env`` registers ``draftgym/SpecDecode-v0`` (single env, ``env.spec_env:SpecDecodeEnv``; batched
replay through ``vector_entry_point``, ``env.vector_env:SpecDecodeVectorEnv``) and ``draftgym/SpecServe-v0`` (a
server under load, ``env.serve_env``) and loads nothing heavy: model code
loads on first use.
"""

ENV_ID = "draftgym/SpecDecode-v0"
SERVE_ID = "draftgym/SpecServe-v0"


def _register() -> None:
    import gymnasium

    if ENV_ID not in gymnasium.registry:
        gymnasium.register(
            id=ENV_ID,
            entry_point="env.spec_env:SpecDecodeEnv",
            vector_entry_point="env.vector_env:SpecDecodeVectorEnv",
        )
    if SERVE_ID not in gymnasium.registry:
        gymnasium.register(
            id=SERVE_ID,
            entry_point="env.serve_env:SpecServeEnv",
            vector_entry_point="env.serve_env:SpecServeVectorEnv",
        )


_register()
