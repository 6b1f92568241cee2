#!/usr/bin/env python3
"""Splits a redis-server's CPU profile into where a fleet decision's cost goes.

Reads the text of `perf script -F comm,tid,time,event,ip,sym,dso` of one redis-server
(recorded with call graphs: `perf record -e cpu-clock --call-graph dwarf -p PID`) and
gives each sample to one part, by its stack:

* kernel samples by the system call that entered the kernel (the first user-space frame):
  the reply's write (on loopback it also delivers the bytes and wakes the client), the
  event loop's epoll_wait, the request's read;
* samples under the module's command (`RedisModuleCommandDispatcher`) by the module API
  function the module called (the slot check's `RM_Call`, keys opened and read, the
  write and its replication), or the module's own code when the sample is in it;
* the rest by the Redis phase it is in: reading and parsing the request, the command's
  dispatch, cron, the event loop.

Usage: perf_split.py PERF_SCRIPT_TEXT [SUMMED_US]
With SUMMED_US (the run's Redis CPU per decision summed over the masters) each part is
also shown in µs per decision, as if every master spent its CPU as the profiled one.
"""
import collections
import re
import sys

MODULE = "libratelimit_redis_module"
FRAME = re.compile(r"\s+([0-9a-f]+)\s+(.*?)\s+\((.*)\)$")

SLOT_CHECK = {"RM_Call", "RM_FreeCallReply", "callReplyType", "RM_CallReplyType",
              "RM_CallReplyInteger"}
KEYS = {"RM_OpenKey", "RM_CloseKey", "RM_KeyType", "RM_StringDMA", "RM_StringPtrLen"}
WRITE = {"RM_StringSet", "RM_Replicate", "RM_SetAbsExpire"}


def part(stack):
    """The part a sample's stack (leaf first, (symbol, dso) pairs) belongs to."""
    syms = [s for s, _ in stack]
    if "kernel" in stack[0][1]:
        user = [s for s, d in stack if "kernel" not in d]
        entry = user[0] if user else "?"
        if "write" in entry:
            return "kernel: write (the reply; loopback delivery, waking the client)"
        if "epoll" in entry:
            return "kernel: epoll_wait (sleeping and waking)"
        if "read" in entry:
            return "kernel: read (the request)"
        return "kernel: other"
    if "RedisModuleCommandDispatcher" in syms:
        if MODULE in stack[0][1]:
            return "command: the module's own code"
        # The Redis function the module called: the frame just leafward of the
        # module frame nearest the leaf.
        called = None
        for i, (_, dso) in enumerate(stack):
            if MODULE in dso:
                called = stack[i - 1][0] if i > 0 else None
                break
        if called in SLOT_CHECK:
            return "command: slot check (RM_Call of one key per check)"
        if called in KEYS:
            return "command: keys opened and read (RM_OpenKey, RM_CloseKey, DMA)"
        if called in WRITE:
            return "command: the write (RM_StringSet, RM_Replicate, RM_SetAbsExpire)"
        return "command: other (module API, allocation, the reply, the dispatcher)"
    if "processCommand" in syms or "call" in syms:
        return "dispatch: processCommand, call (lookup, ACL, cluster, stats)"
    if any(s.startswith(("processInputBuffer", "processMultibulkBuffer",
                         "readQueryFromClient")) for s in syms):
        return "request: read and parse (arguments as string objects)"
    if any(s.startswith(("serverCron", "clientsCron", "databasesCron",
                         "activeExpireCycle")) for s in syms):
        return "cron and expiry (serverCron, activeExpireCycle)"
    return "event loop, replies' user side and the rest"


def main():
    path = sys.argv[1]
    summed = float(sys.argv[2]) if len(sys.argv) > 2 else None
    parts = collections.Counter()
    stack = []

    def flush():
        if stack:
            parts[part(stack)] += 1
            stack.clear()

    with open(path, errors="replace") as text:
        for line in text:
            line = line.rstrip("\n")
            if not line.strip():
                flush()
            elif line[0] in " \t":
                m = FRAME.match(line)
                if m:
                    stack.append((re.sub(r"\+0x[0-9a-f]+$", "", m.group(2)), m.group(3)))
            else:
                flush()
    flush()
    total = sum(parts.values())
    print(f"{total} samples")
    for name, n in sorted(parts.items()):
        share = n / total
        us = f" | {summed * share:.2f}" if summed is not None else ""
        print(f"| {name} | {100 * share:.1f} %{us} |")


if __name__ == "__main__":
    main()
