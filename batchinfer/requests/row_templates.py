"""The templates a run fills from each row (prompt.template, or score's task.query and
task.document) checked against the input's columns before anything runs: prepare, validate and
plan all ask this one function."""

from __future__ import annotations

from batchinfer.config.schema import Config
from batchinfer.errors import ConfigError
from batchinfer.requests.prompts import check_fields, load_template


def check_row_templates(c: Config, columns: list[str], source: str) -> None:
    """Every field of the run's row templates must be an input column (unless rows carry their own
    messages); the error names the key of the template: prompt.template, task.query or task.document."""
    if c.task.name == "score":  # its two texts are task.query and task.document; prompt.template is unused
        templates = {"task.query": c.task.query or "", "task.document": c.task.document or ""}
    else:
        templates = {"prompt.template": load_template(c.prompt)}
    for key, template in templates.items():
        try:
            check_fields(template, columns, source)
        except ConfigError as e:  # check_fields speaks of prompt.template
            raise ConfigError(str(e).replace("prompt.template", key, 1)) from None
