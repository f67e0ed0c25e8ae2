"""The jinja2 templates (templates/ at the repo's top; hpc_rl/templates links there and ships in the wheel)."""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

# Not resolved: in a checkout this is the link to ../templates, in an installed wheel a real folder.
TEMPLATES = Path(__file__).parent / "templates"


def render(template: str, /, **values) -> str:
    """Render templates/TEMPLATE with `values`; an undefined name is an error, not an empty string."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters["sh"] = lambda v: shlex.quote(str(v))
    return env.get_template(template).render(**values)
