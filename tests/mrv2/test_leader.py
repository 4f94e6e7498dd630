"""The FFN role's serving worker ends with its role process (afd_mrv2.mrv2.ffn.leader), without vLLM."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest

from afd_mrv2.mrv2.ffn.leader import LEADER_KEY, leader_alive, leader_pid, watch_leader, watch_role_leader


def test_a_killed_leader_is_gone_even_before_it_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert leader_alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 5
        while leader_alive(child.pid) and time.monotonic() < deadline:  # a zombie until wait() below
            time.sleep(0.01)
        assert not leader_alive(child.pid), "an exited, unreaped leader still counted as alive"
    finally:
        child.kill()
        child.wait()
    assert not leader_alive(child.pid)


def test_the_watch_calls_back_once_the_leader_exits() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = threading.Event()
    try:
        watch_leader(child.pid, gone.set, interval_s=0.02)
        assert not gone.wait(0.3), "called back while the leader lives"
        child.kill()
        assert gone.wait(5), "the watch missed the leader's exit"
    finally:
        child.kill()
        child.wait()


def test_a_stopped_watch_never_calls_back() -> None:
    """The session ended on its own: the leader's normal exit afterwards ends nothing."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = threading.Event()
    try:
        watch = watch_leader(child.pid, gone.set, interval_s=0.02)
        watch.stop()
        child.kill()
        child.wait()
        watch.thread.join(5)
        assert not watch.thread.is_alive() and not gone.is_set()
    finally:
        child.kill()
        child.wait()


def test_the_leader_pid_comes_from_the_engines_additional_config() -> None:
    assert leader_pid({LEADER_KEY: 1234, "afd": {}}) == 1234
    for config in (None, {}, {LEADER_KEY: "1234"}, {LEADER_KEY: True}, {LEADER_KEY: 0}):
        assert leader_pid(config) is None, config
    assert watch_role_leader(None) is None


def test_a_worker_in_the_leaders_group_takes_the_group_down(tmp_path) -> None:
    """Leader (session leader) -> its child watching it; SIGKILL the leader: the child's group is gone."""
    child_code = (
        "import os, time\n"
        "from afd_mrv2.mrv2.ffn.leader import watch_role_leader\n"
        "watch_role_leader(os.getppid())\n"
        f"open({str(tmp_path / 'watching')!r}, 'w').close()\n"
        "time.sleep(60)\n"
    )
    leader_code = (
        f"import os, subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child_code!r}])\ntime.sleep(60)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", leader_code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "watching").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "watching").exists(), "the child never started watching"
        leader.kill()
        leader.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(leader.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("a process of the leader's group outlived it by 10 s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, 9)
