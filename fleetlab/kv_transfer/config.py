"""``KVTransferConfig``: which connector an engine uses, in which role, with which options.

``LLM(kv_transfer_config={"connector": "shared_storage", "role": "both", "path": "/tmp/kv"})``:
``connector`` is a registered name (``fleetlab.kv_transfer.KV_CONNECTORS``), a
:class:`~fleetlab.kv_transfer.base.KVConnector` subclass or an instance; ``role`` is
``"producer"`` (saves / sends), ``"consumer"`` (loads / receives) or ``"both"``; every other key
is one of the connector's ``options``. vLLM spells the same ``KVTransferConfig(kv_connector=...,
kv_role="kv_producer" | "kv_consumer" | "kv_both", kv_connector_extra_config={...})``;
FastDeploy ``--splitwise-role prefill | decode``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("producer", "consumer", "both")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """A checked connector choice (build one with :func:`check_kv_transfer_config`)."""

    connector: object
    role: str = "both"
    options: dict = field(default_factory=dict)


def check_kv_transfer_config(value) -> KVTransferConfig:
    """A :class:`KVTransferConfig` from a dict (or one already built); raise ValueError /
    TypeError naming the field (``kv_transfer_config field role: ...``)."""
    from fleetlab.kv_transfer.base import KV_CONNECTORS

    where = "engine config: kv_transfer_config"
    if isinstance(value, KVTransferConfig):
        value = {"connector": value.connector, "role": value.role, **value.options}
    if not isinstance(value, dict):
        raise TypeError(f"{where} must be a dict like {{'connector': NAME, 'role': 'both', ...}}; got {value!r:.60}")
    if "connector" not in value:
        raise ValueError(f"{where} field connector is missing; registered: {KV_CONNECTORS.names()}")
    options = dict(value)
    spec, role = options.pop("connector"), options.pop("role", "both")
    try:
        cls = KV_CONNECTORS.resolve(spec)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where} field connector: {exc}") from None
    if role not in ROLES:
        raise ValueError(f"{where} field role: must be one of {list(ROLES)}; got {role!r:.40}")
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise ValueError(f"{where} field(s) {unknown}: not options of KV connector {cls.name!r} "
                         f"(its options: {sorted(cls.options)})")
    try:
        options = cls.check_options(options)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where} {exc}") from None
    return KVTransferConfig(spec, role, options)


def make_kv_connector(config: KVTransferConfig | None, kv_cache):
    """The connector ``config`` names, built for ``kv_cache`` (the null connector for None)."""
    from fleetlab.kv_transfer.base import KV_CONNECTORS, NULL_CONNECTOR, KVCacheSpec

    if config is None:
        return NULL_CONNECTOR
    connector = KV_CONNECTORS.make(config.connector, config, KVCacheSpec.of(kv_cache))
    if connector.spec is None:  # an instance built by hand: it learns the cache now
        connector.config, connector.role, connector.spec = config, config.role, KVCacheSpec.of(kv_cache)
    return connector
