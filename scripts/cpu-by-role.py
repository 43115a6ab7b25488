#!/usr/bin/env python3
"""CPU time per role while outbox-bench runs, for the relays scenario.

    python3 scripts/cpu-by-role.py sample OUT -- outbox-bench -scenarios relays -n 500000 -json
    python3 scripts/cpu-by-role.py drains OUT 500000

`sample` runs the command with its standard output in OUT and, every
50 ms until it exits, adds up the CPU time (user + system, from
/proc/PID/stat) that each role used since the last sample, as one JSON line
in OUT.cpu. The roles: db (postgres, mariadbd), the bench's children by
their OUTBOX_BENCH_ROLE (relay, broker, consumer), bench (the bench process
itself) and other. Linux only; it reads, and changes, nothing else.

`drains` cuts the samples into drains (runs of samples where relay
processes use CPU, gaps of up to two samples bridged) and prints each
drain's CPU seconds per role per 100,000 messages, given the messages per
drain (the relays scenario drains a warm-up backlog and then the measured
one, both of -n messages, for each relay count).
"""
import json
import os
import subprocess
import sys
import time

HZ = os.sysconf('SC_CLK_TCK')
ROLES = ['db', 'relay', 'broker', 'bench', 'other']


def role_of(pid, comm, cache):
    if pid in cache:
        return cache[pid]
    role = 'other'
    if comm in ('postgres', 'mariadbd', 'mysqld'):
        role = 'db'
    else:
        try:
            env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
        except OSError:
            env = []
        for e in env:
            if e.startswith(b'OUTBOX_BENCH_ROLE='):
                role = e.split(b'=', 1)[1].decode()
        if role == 'other' and pid == cache.get('root'):
            role = 'bench'
    cache[pid] = role
    return role


def read_cpu(cache):
    """Cumulative CPU seconds per live PID, with its role."""
    out = {}
    for d in os.listdir('/proc'):
        if not d.isdigit():
            continue
        pid = int(d)
        try:
            stat = open(f'/proc/{pid}/stat').read()
        except OSError:
            continue
        comm = stat[stat.index('(') + 1:stat.rindex(')')]
        fields = stat[stat.rindex(')') + 2:].split()
        out[pid] = (role_of(pid, comm, cache), (int(fields[11]) + int(fields[12])) / HZ)
    return out


def sample(out, cmd):
    proc = subprocess.Popen(cmd, stdout=open(out, 'w'))
    cache = {'root': proc.pid}
    last = {pid: cpu for pid, (_, cpu) in read_cpu(cache).items()}
    with open(out + '.cpu', 'w') as w:
        while proc.poll() is None:
            time.sleep(0.05)
            used, relays = {}, 0
            for pid, (role, cpu) in read_cpu(cache).items():
                used[role] = used.get(role, 0.0) + cpu - last.get(pid, 0.0)
                last[pid] = cpu
                relays += role == 'relay'
            w.write(json.dumps({'t': round(time.time(), 3), 'relays': relays,
                                **{r: round(v, 3) for r, v in used.items()}}) + '\n')
    return proc.returncode


def drains(path, n):
    rows = [json.loads(line) for line in open(path)]
    segs, cur, gap = [], None, 0
    for r in rows:
        if r['relays'] > 0 and r.get('relay', 0) >= 0.025:
            if cur is None or cur['relays'] != r['relays'] or gap > 2:
                cur = {'relays': r['relays'], 'samples': 0, **{k: 0.0 for k in ROLES}}
                segs.append(cur)
            for k in ROLES:
                cur[k] += max(r.get(k, 0.0), 0.0)
            cur['samples'] += 1
            gap = 0
        else:
            gap += 1
    per = 100000 / n
    print('relays samples ' + ' '.join(f'{k:>7}' for k in ROLES) + '   total   (CPU seconds per 100k messages)')
    for s in segs:
        if s['samples'] < 4:
            continue
        total = sum(s[k] for k in ROLES)
        print(f"{s['relays']:>6} {s['samples']:>7} " + ' '.join(f'{s[k] * per:7.3f}' for k in ROLES) + f'  {total * per:6.3f}')


if __name__ == '__main__':
    if len(sys.argv) >= 4 and sys.argv[1] == 'sample':
        cmd = sys.argv[3:]
        if cmd and cmd[0] == '--':
            cmd = cmd[1:]
        sys.exit(sample(sys.argv[2], cmd))
    if len(sys.argv) == 4 and sys.argv[1] == 'drains':
        drains(sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    sys.exit(__doc__)
