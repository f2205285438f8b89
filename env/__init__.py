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
    """Both ids, made without gymnasium's passive checker (both envs pass ``check_env``, in the tests): in
    gymnasium 1.4 a first ``reset`` that refuses its arguments (``reset(seed=-1)``) leaves the checker without the
    data it compares the first ``step`` with, and every later ``step`` of that env fails with a ``TypeError``.
    ``gymnasium.make(ID, disable_env_checker=False)`` puts it back."""
    import gymnasium

    if ENV_ID not in gymnasium.registry:
        gymnasium.register(
            id=ENV_ID,
            entry_point="env.spec_env:SpecDecodeEnv",
            vector_entry_point="env.vector_env:SpecDecodeVectorEnv",
            disable_env_checker=True,
        )
    if SERVE_ID not in gymnasium.registry:
        gymnasium.register(
            id=SERVE_ID,
            entry_point="env.serve_env:SpecServeEnv",
            vector_entry_point="env.serve_env:SpecServeVectorEnv",
            disable_env_checker=True,
        )


_register()
