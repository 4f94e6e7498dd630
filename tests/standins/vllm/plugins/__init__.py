"""Stand-in for vllm.plugins: the general-plugins entry-point group."""

DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"


def load_general_plugins():
    from importlib.metadata import entry_points

    for plugin in entry_points(group=DEFAULT_PLUGINS_GROUP):
        plugin.load()()
