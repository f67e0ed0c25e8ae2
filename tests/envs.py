"""Environments the tests run through the real multi-turn loop (importable as tests.envs:Name)."""

import itertools
import json
import os
from pathlib import Path
from urllib.parse import urlsplit

from hpc_rl.rollout.environments.base import Environment, first_messages
from hpc_rl.rollout.environments.tools import python_tool


class EchoEnv(Environment):
    """Every assistant turn gets a tool observation (`seen N`) until `turns` turns; reward 0.5 per observation."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def reset(self, row):
        self.n = 0
        return first_messages(row)

    def step(self, message):
        self.n += 1
        if self.n >= self.turns:
            return None, 0.0, True
        return [{"role": "tool", "content": f"seen {self.n}"}], 0.5, False


# Model-written code that must end as a one-line observation, harming nothing outside the sandbox. {token},
# {home}, {outside}, {pid}, {addr}, {port}, {sockets} and {fifo} are filled in by HostileEnv: the run's token file,
# the user's home, a path outside the sandbox, the trainer's pid, the rollout server's address and port, path UNIX
# sockets listening outside and a FIFO outside with a reader.
HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "infinite_loop": "while True:\n    pass",
    "alloc_10gb": "x = bytearray(10 * 2**30)\nprint(len(x))",
    "output_100mb": "import sys\nsys.stdout.write('x' * 100_000_000)",
    "write_outside": "open({outside!r}, 'w').write('pwned')\nprint('wrote')",
    "read_token": "print(open({token!r}).read())",
    "read_ssh": "import os\nprint(open(os.path.join({home!r}, '.ssh', 'id_rsa')).read())",
    "socket_loopback": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
    "socket_server": "import socket\nsocket.create_connection(({addr!r}, {port}), timeout=2)\nprint('connected')",
    "kill_parent": "import os, signal\nos.kill({pid}, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)\nprint('alive')",
    "ctypes": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "r = [libc.umount2(b'/proc', 2), libc.unshare(0x10000000), libc.mount(b'x', b'/tmp', b'tmpfs', 0, None)]\n"
               "raise SystemExit('refused: ' + ' '.join(str(-x) for x in r))"),
    "unix_sockets": ("import socket\nerrs = []\nfor p in {sockets!r}:\n    try:\n"
                     "        socket.socket(socket.AF_UNIX).connect(p)\n        print('connected', p)\n"
                     "    except OSError as e:\n        errs.append(type(e).__name__)\n"
                     "raise SystemExit('unreachable: ' + ' '.join(errs))"),
    "fifo": "import os\nfd = os.open({fifo!r}, os.O_WRONLY | os.O_NONBLOCK)\nos.write(fd, b'x')\nprint('wrote')",
}
HOSTILE_NAMES = sorted(HOSTILE)
_next_case = itertools.count()


class HostileEnv(Environment):
    """Each trajectory runs the next case of HOSTILE through the python tool, whatever the model said, and gets its
    output as the observation; the case and the observation are appended to `log` (JSON lines) for the test."""

    def __init__(self, log: str, outside: str, sockets: list | None = None, fifo: str = "/nonexistent"):
        self.log, self.outside, self.sockets, self.fifo = log, outside, sockets or [], fifo

    def reset(self, row):
        self.case = HOSTILE_NAMES[next(_next_case) % len(HOSTILE_NAMES)]
        self.done = False
        return first_messages(row)

    def step(self, message):
        if self.done:
            return None, 0.0, True
        self.done = True
        run_dir = self.context.hide[0]
        url = urlsplit(json.loads((Path(run_dir) / "rendezvous" / "rollout-0.json").read_text())["url"])
        code = HOSTILE[self.case].format(token=os.path.join(run_dir, "token"), home=os.path.expanduser("~"),
                                         outside=self.outside, pid=os.getpid(), addr=url.hostname, port=url.port,
                                         sockets=self.sockets, fifo=self.fifo)
        out = python_tool({"code": code}, self.context)
        with open(self.log, "a") as f:
            f.write(json.dumps({"case": self.case, "observation": out}) + "\n")
        return [{"role": "tool", "content": out}], None, False


class SlowEnv(EchoEnv):
    """EchoEnv whose first step sleeps `sleep_s` (past rollout.tool_timeout_s in the test)."""

    def __init__(self, sleep_s: float = 3.0):
        super().__init__(turns=3)
        self.sleep_s = sleep_s

    def step(self, message):
        import time

        if self.n == 0:
            time.sleep(self.sleep_s)
        return super().step(message)
