"""A verifiers environment's tasks as prompts: `data.source: verifiers:ID` (or `eval.source`) with `data.kwargs`, the
taskset's config. Rows keep the task (`verifiers_task`: its data as JSON), which the environment's episodes play
(hpc_rl.orchestrator.verifiers_env)."""

from __future__ import annotations

from ..errors import ConfigError, DataError, first_line
from .extras import import_extra

PREFIX = "verifiers:"


def is_verifiers(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def import_verifiers(key: str):
    return import_extra("verifiers.v1", key, "verifiers: environments need the verifiers package", ConfigError)


def check_id(spec: str, key: str) -> str:
    """The environment id of `verifiers:ID`; ConfigError unless it is one verifiers can load."""
    ident = spec[len(PREFIX):]
    if not ident:
        raise ConfigError(f"{key}: {spec!r} names no environment; e.g. verifiers:my_env (an installed verifiers "
                          "environment, or a module on PYTHONPATH)")
    if "." in ident.rsplit("/", 1)[-1].split("@", 1)[0]:
        raise ConfigError(f"{key}: {spec!r}: verifiers loads an environment by its top-level module or package "
                          "name (installed, or on PYTHONPATH), not a dotted path")
    return ident


def verifiers_rows(spec: str, kwargs: dict, section: str = "data") -> list[dict]:
    """The rows of `verifiers:ID`'s taskset: id (the task's position), prompt (its text, or its messages as a chat,
    the system prompt first) and verifiers_task."""
    import_verifiers(f"{section}.source")
    from pydantic import ValidationError
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.types import content_text
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import taskset_class

    ident = check_id(spec, f"{section}.source")
    try:
        cls = taskset_class(ident)
        cfg_cls = concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig
        taskset = cls(cfg_cls.model_validate({**dict(kwargs or {}), "id": ident}))
    except ValidationError as e:
        err = e.errors()[0]
        raise DataError(f"{section}.kwargs.{'.'.join(map(str, err['loc']))}: {err['msg']} (the {spec} taskset's "
                        "config)") from None
    except Exception as e:  # noqa: BLE001 - verifiers' loader errors say what is missing
        raise DataError(f"{section}.source: {spec}: {first_line(e)}") from None
    if not taskset.bounded:
        raise DataError(f"{section}.source: {spec}'s taskset never ends; bound it in {section}.kwargs (its config) so "
                        "that its tasks can be the run's prompts")
    out = []
    for i, task in enumerate(taskset):
        d = task.data
        if isinstance(d.prompt, str) or d.prompt is None:
            chat = [{"role": "user", "content": d.prompt or ""}]
        else:
            chat = [{"role": m.role, "content": content_text(m.content)} for m in d.prompt]
        if d.system_prompt:
            chat = [{"role": "system", "content": d.system_prompt}] + chat
        prompt = chat[0]["content"] if len(chat) == 1 and chat[0]["role"] == "user" else chat
        out.append({"id": i, "prompt": prompt, "verifiers_task": d.model_dump(mode="json")})
    return out
