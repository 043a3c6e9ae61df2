"""``model.path`` as a hub repo id (``ORG/NAME``) → the local snapshot directory every process of a deployment loads.

Where it is resolved, and why there:

* ``kvrelay up`` and ``kvrelay serve`` resolve once, in the parent, before any node starts (the download, with its
  progress, happens there), and start every node — router, prefill, decode, and any restart of one — with
  ``--model <snapshot directory> --served-model-name <name>``. The nodes never look at the hub: they all load the
  same commit even if the repo's ``main`` moves meanwhile (one fingerprint, so KV moves between them), and a node
  restarted later does not download again.
* ``kvrelay router|prefill|decode`` run alone (one pod each, `deploy/k8s`) resolve for themselves, reading the hub
  cache they are given (a shared volume, ``HF_HUB_OFFLINE=1``, and a ``model.revision`` commit make them agree).
* ``kvrelay generate`` and ``LLM()`` resolve their ``--model`` / ``model`` argument themselves (`model.hub`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvrelay.deploy.sizes import ConfigError
from kvrelay.model.hub import HubError, is_hub_id, resolve_model

if TYPE_CHECKING:
    from kvrelay.deploy.config import Config


def resolve_config_model(config: Config) -> Config:
    """``config`` with ``model.path`` a local directory: unchanged when it already is one, else the hub snapshot of
    the repo id it names (``model.revision``, ``model.download_dir``), fetched if need be. ``model.name`` stays
    (the repo id unless the config names it).

    Raises:
        ConfigError: ``model.path: <why the repo could not be resolved and what to do>``.
    """
    m = config.model
    if not is_hub_id(m.path):  # parse_services made every local path absolute: an id here is not a local path
        return config
    try:
        source = resolve_model(m.path, revision=m.revision, download_dir=m.download_dir)
    except HubError as exc:
        raise ConfigError(f"model.path: {exc}") from None
    return dataclasses.replace(config, model=dataclasses.replace(m, path=str(source.path)))


def node_overrides(config: Config) -> list[str]:
    """The flags that give each node of `kvrelay up` the resolved model: its directory and its served name."""
    return ["--model", config.model.path, "--served-model-name", config.model.name]
