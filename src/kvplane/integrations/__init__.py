"""L7 integrations: kvplane inside third-party serving engines.

Each engine gets its own subpackage; the engine itself is imported only inside the module that
subclasses its plug-in class (``integrations/vllm/connector.py``), so ``import kvplane`` never
needs the engine installed.
"""
