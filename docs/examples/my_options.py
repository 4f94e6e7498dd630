# docs/examples/my_options.py: a connector's connector_extra_config, parsed with afd-mrv2's options
from dataclasses import dataclass

from afd_mrv2 import ConnectorContext
from afd_mrv2.options import integer, one_of, option, parse_section


@dataclass(frozen=True)
class MyOptions:
    queue_depth: int = option(integer(1, 64), 4)
    transport: str = option(one_of(("rdma", "tcp")), "rdma")


def my_options(context: ConnectorContext) -> MyOptions:
    return parse_section(MyOptions, context.config.extra, "afd.connector_extra_config")


if __name__ == "__main__":  # run it: python docs/examples/my_options.py
    from afd_mrv2.config import parse_afd_config
    from afd_mrv2.errors import ConfigError

    config = parse_afd_config({"connector": "my_link", "role": "ffn", "connector_extra_config": {"transport": "tcp"}})
    print(my_options(ConnectorContext(config)))
    try:
        my_options(
            ConnectorContext(
                parse_afd_config({"connector": "my_link", "role": "ffn", "connector_extra_config": {"queue_depth": 0}})
            )
        )
    except ConfigError as refused:
        print(f"refused: {refused}")
    else:
        raise SystemExit("queue_depth 0 was accepted")
