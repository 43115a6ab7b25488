package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// This file holds the network of the network-fault chaos test: every
// relay process runs in a network namespace of its own, reaching the
// brokers over one veth pair and the database over another, and the
// injector breaks those links with tc. Nothing outside the namespaces and
// veth pairs the test created is ever changed.
//
// Layout, for relay slot s in the run's 10.A.B.0/24:
//
//	namespace oxchaos-<pid>-<run>-<s>
//	  broker link  10.A.B.(8s+2) <-> 10.A.B.(8s+1)  root namespace
//	  database link 10.A.B.(8s+6) <-> 10.A.B.(8s+5)  root namespace
//	  route 10.A.B.250/32 via 10.A.B.(8s+1)
//
// The in-process kfake cluster listens on 10.A.B.250, an address of a
// veth pair that stays in the root namespace (the brokers advertise the
// address they listen on, so the relays and the test's own clients use
// the same one). The database is reached through a TCP forwarder in this
// process listening on 10.A.B.(8s+5), one per slot: PostgreSQL itself
// listens on loopback only, and the forwarder's far side is loopback, so
// what a fault on the database link breaks is the relay's own connection.
//
// The kernel's tc may lack netem (sch_netem) and every tc action. The
// faults then use what any kernel with tbf, htb and u32 has: a tbf whose
// bucket is smaller than any packet drops everything (a partition); a tbf
// at a low rate queues up to two seconds (a slow, delaying link); an htb
// whose u32 filter sends every 4th, 8th or 16th IP packet by its IP
// identification to such a dropping tbf (25%, 12.5%, 6.25% loss; a
// retransmission carries a new identification, so it is not lost for
// good). With netem the delay and loss are netem's.
//
// With a cluster of several brokers of their own addresses (Apache Kafka,
// newNetLabBrokers), a relay reaches each broker over a link of its own
// instead of the one broker link, so that a fault can cut it off from one
// broker only; the brokers talk to each other in the root namespace:
//
//	broker i link 10.A.B.(100+16s+4i+2) <-> 10.A.B.(100+16s+4i+1)
//	route <broker i's address>/32 via 10.A.B.(100+16s+4i+1)
//
// The brokers' addresses, 10.C.D.(241+i), are on the brokers' pair of a
// network of their own (newBrokerAddrs), which outlives the runs that
// share the cluster. A fault on linkBroker applies to every broker link.

// Names: every namespace and link of a run carries the test process's
// pid, so that a sweep can remove what a dead process left behind and
// never touches what a running one uses.
const (
	nsPrefix   = "oxchaos-"
	linkPrefix = "oxc"
	// linkNameLen: "oxc", the pid in base 36 on 5 characters, the run,
	// the slot, the link and the side: 12 characters (the kernel allows
	// 15).
	linkNameLen = 12
)

var netRuns atomic.Int32

// EnvNetRequired=1 makes a missing ip, tc or root fail the network-fault
// test instead of skipping it, as CI=true does.
const EnvNetRequired = "OUTBOX_CHAOS_NET_REQUIRED"

// requireNetTools skips (fails in CI) when the test cannot build its
// network: not root, or no ip/tc.
func requireNetTools(t *testing.T) {
	t.Helper()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root")
	}
	for _, tool := range []string{"ip", "tc"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool+" (Debian package iproute2)")
		}
	}
	if len(missing) == 0 {
		return
	}
	msg := "the network-fault chaos test needs " + strings.Join(missing, ", ")
	if os.Getenv("CI") == "true" || os.Getenv("CI") == "1" || os.Getenv(EnvNetRequired) == "1" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

type linkKind int

const (
	linkBroker linkKind = iota
	linkDB
	// linkToBroker is the first of the links to one broker each
	// (newNetLabBrokers): broker i's is linkToBroker + i.
	linkToBroker
)

func (k linkKind) String() string {
	switch {
	case k == linkBroker:
		return "brokers"
	case k == linkDB:
		return "database"
	}
	return fmt.Sprintf("broker %d", k-linkToBroker+1)
}

// maxBrokerLinks bounds the links to one broker each per relay.
const maxBrokerLinks = 4

// netLab is the network of one run.
type netLab struct {
	t     *testing.T
	pid   int
	run   int
	slots int
	net   [2]byte // 10.A.B.0/24
	netem bool    // the kernel has sch_netem
	// brokerLinks is the number of brokers with a link of their own from
	// each namespace, brokerIPs their addresses; 0: one link to the
	// brokers' shared address.
	brokerLinks int
	brokerIPs   []string

	mu      sync.Mutex
	faulted map[[2]int]string // (slot, link) -> fault in place
	proxies []*forwarder
}

func base36(n int) string {
	s := strconv.FormatInt(int64(n), 36)
	for len(s) < 5 {
		s = "0" + s
	}
	return s
}

func (l *netLab) nsName(slot int) string {
	return fmt.Sprintf("%s%d-%d-%d", nsPrefix, l.pid, l.run, slot)
}

// linkName is the veth end of slot's link on side 'h' (root namespace) or
// 'n' (the relay's namespace); slot -1 is the brokers' own pair.
func (l *netLab) linkName(slot int, k linkKind, side byte) string {
	s, kind := byte('0'+slot), byte("bd0123"[k])
	if slot < 0 {
		s, kind = 'k', 'k'
	}
	return linkPrefix + base36(l.pid) + string(rune('0'+l.run%10)) + string(s) + string(kind) + string(side)
}

func (l *netLab) addr(last int) string { return fmt.Sprintf("10.%d.%d.%d", l.net[0], l.net[1], last) }

// hostAddr and nsAddr are the two ends of slot's link.
func (l *netLab) hostAddr(slot int, k linkKind) string { return l.addr(l.linkBase(slot, k) + 1) }
func (l *netLab) nsAddr(slot int, k linkKind) string   { return l.addr(l.linkBase(slot, k) + 2) }

// linkBase is the network address of slot's link k, a /30.
func (l *netLab) linkBase(slot int, k linkKind) int {
	if k >= linkToBroker {
		return 100 + 16*slot + 4*int(k-linkToBroker)
	}
	return 8*slot + 4*int(k)
}

// brokerHost is the address the brokers listen on.
func (l *netLab) brokerHost() string { return l.addr(250) }

// brokerAddr is broker i's own address (0-based), with brokerLinks set.
func (l *netLab) brokerAddr(i int) string { return l.brokerIPs[i] }

// kinds are the links of every slot.
func (l *netLab) kinds() []linkKind {
	if l.brokerLinks == 0 {
		return []linkKind{linkBroker, linkDB}
	}
	ks := []linkKind{linkDB}
	for i := range l.brokerLinks {
		ks = append(ks, linkToBroker+linkKind(i))
	}
	return ks
}

func ipCmd(args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// sweepNet removes the namespaces and links that test processes which no
// longer run left behind (a test killed before its cleanup ran).
func sweepNet(t *testing.T) {
	alive := func(pid int) bool {
		_, err := os.Stat("/proc/" + strconv.Itoa(pid))
		return err == nil
	}
	if out, err := exec.Command("ip", "netns", "list").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
			rest, ok := strings.CutPrefix(name, nsPrefix)
			if !ok {
				continue
			}
			pidText, _, _ := strings.Cut(rest, "-")
			if pid, err := strconv.Atoi(pidText); err == nil && !alive(pid) {
				if err := ipCmd("ip", "netns", "del", name); err != nil {
					t.Logf("chaos net: sweep: %v", err)
				}
			}
		}
	}
	if out, err := exec.Command("ip", "-o", "link", "show").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
			if len(name) != linkNameLen || !strings.HasPrefix(name, linkPrefix) {
				continue
			}
			pid, err := strconv.ParseInt(name[len(linkPrefix):len(linkPrefix)+5], 36, 64)
			if err == nil && !alive(int(pid)) {
				if err := ipCmd("ip", "link", "del", name); err != nil {
					t.Logf("chaos net: sweep: %v", err)
				}
			}
		}
	}
}

// newNetLab builds the namespaces and links of a run with slots relays,
// and removes them when the test ends, whatever its outcome.
func newNetLab(t *testing.T, slots int, seed uint64) *netLab {
	t.Helper()
	return buildNetLab(t, slots, seed, 0, nil)
}

// newBrokerAddrs puts n addresses, 10.A.B.241 and up, on a veth pair of
// the root namespace (a network with no relay slot), for brokers to
// listen on; newNetLabBrokers routes a run's namespaces to them.
func newBrokerAddrs(t *testing.T, seed uint64, n int) *netLab {
	t.Helper()
	if n < 1 || n > maxBrokerLinks {
		t.Fatalf("chaos net: %d brokers: at most %d", n, maxBrokerLinks)
	}
	return buildNetLab(t, 0, seed, n, nil)
}

// newNetLabBrokers builds the network of a run whose brokers listen on
// addrs (newBrokerAddrs): every namespace reaches each over a link of its
// own.
func newNetLabBrokers(t *testing.T, slots int, seed uint64, addrs []string) *netLab {
	t.Helper()
	if len(addrs) < 1 || len(addrs) > maxBrokerLinks || slots > 8 {
		t.Fatalf("chaos net: %d brokers, %d slots: at most %d brokers and 8 slots", len(addrs), slots, maxBrokerLinks)
	}
	return buildNetLab(t, slots, seed, len(addrs), addrs)
}

// buildNetLab builds a run's network. brokerLinks > 0 gives each slot a
// link to each broker, whose addresses are addrs, or with addrs nil
// addresses of this network put on the brokers' pair.
func buildNetLab(t *testing.T, slots int, seed uint64, brokerLinks int, addrs []string) *netLab {
	t.Helper()
	requireNetTools(t)
	sweepNet(t)
	l := &netLab{t: t, pid: os.Getpid(), run: int(netRuns.Add(1)), slots: slots, faulted: map[[2]int]string{}, brokerLinks: brokerLinks}
	l.pickNet(seed)
	t.Cleanup(l.teardown)
	own := brokerLinks > 0 && addrs == nil
	if own {
		for i := range brokerLinks {
			addrs = append(addrs, l.addr(241+i))
		}
	}
	l.brokerIPs = addrs

	// The brokers' pair: both ends in the root namespace, the address on
	// one of them.
	kh, kn := l.linkName(-1, linkBroker, 'h'), l.linkName(-1, linkBroker, 'n')
	steps := [][]string{
		{"ip", "link", "add", kh, "type", "veth", "peer", "name", kn},
		{"ip", "addr", "add", l.brokerHost() + "/32", "dev", kh},
		{"ip", "link", "set", kh, "up"},
		{"ip", "link", "set", kn, "up"},
	}
	for i := range brokerLinks {
		if own {
			steps = append(steps, []string{"ip", "addr", "add", l.brokerAddr(i) + "/32", "dev", kh})
		}
	}
	for s := range slots {
		ns := l.nsName(s)
		steps = append(steps, []string{"ip", "netns", "add", ns}, []string{"ip", "-n", ns, "link", "set", "lo", "up"})
		for _, k := range l.kinds() {
			h, n := l.linkName(s, k, 'h'), l.linkName(s, k, 'n')
			steps = append(steps,
				[]string{"ip", "link", "add", h, "type", "veth", "peer", "name", n, "netns", ns},
				[]string{"ip", "addr", "add", l.hostAddr(s, k) + "/30", "dev", h},
				[]string{"ip", "link", "set", h, "up"},
				[]string{"ip", "-n", ns, "addr", "add", l.nsAddr(s, k) + "/30", "dev", n},
				[]string{"ip", "-n", ns, "link", "set", n, "up"},
			)
		}
		if brokerLinks == 0 {
			steps = append(steps, []string{"ip", "-n", ns, "route", "add", l.brokerHost() + "/32", "via", l.hostAddr(s, linkBroker)})
		}
		for i := range brokerLinks {
			steps = append(steps, []string{"ip", "-n", ns, "route", "add", l.brokerAddr(i) + "/32", "via", l.hostAddr(s, linkToBroker+linkKind(i))})
		}
	}
	for _, st := range steps {
		if err := ipCmd(st...); err != nil {
			t.Fatalf("chaos net: build the network: %v", err)
		}
	}
	// netem, if the kernel has it.
	l.netem = ipCmd("tc", "qdisc", "add", "dev", kn, "root", "netem", "delay", "1ms") == nil
	if l.netem {
		_ = ipCmd("tc", "qdisc", "del", "dev", kn, "root")
	}
	t.Logf("chaos net: %d namespaces on 10.%d.%d.0/24, brokers on %s, netem=%v", slots, l.net[0], l.net[1], l.brokerHost(), l.netem)
	return l
}

// pickNet picks a 10.A.B.0/24 that no interface address or route of the
// root namespace overlaps.
func (l *netLab) pickNet(seed uint64) {
	used := ""
	if out, err := exec.Command("ip", "-4", "-o", "addr", "show").Output(); err == nil {
		used += string(out)
	}
	if out, err := exec.Command("ip", "-4", "route", "show", "table", "all").Output(); err == nil {
		used += string(out)
	}
	x := seed ^ uint64(l.pid)<<8 ^ uint64(l.run)
	for range 1000 {
		x = x*6364136223846793005 + 1442695040888963407
		a, b := byte(100+(x>>33)%150), byte((x>>45)%256)
		prefix := fmt.Sprintf(" 10.%d.%d.", a, b)
		if !strings.Contains(used, prefix) && !strings.Contains(used, fmt.Sprintf(" 10.%d.0.0/", a)) && !strings.Contains(used, " 10.0.0.0/8") {
			l.net = [2]byte{a, b}
			return
		}
	}
	l.t.Fatal("chaos net: no free 10.x.y.0/24")
}

// teardown removes the namespaces (their veth ends and the pairs with
// them), the brokers' pair and the forwarders.
func (l *netLab) teardown() {
	l.mu.Lock()
	proxies := l.proxies
	l.proxies = nil
	l.mu.Unlock()
	for _, p := range proxies {
		p.close()
	}
	for s := range l.slots {
		// Deleting the root end deletes the pair; the namespace goes last.
		for _, k := range l.kinds() {
			_ = ipCmd("ip", "link", "del", l.linkName(s, k, 'h'))
		}
		if err := ipCmd("ip", "netns", "del", l.nsName(s)); err != nil && !strings.Contains(err.Error(), "No such file") {
			l.t.Logf("chaos net: teardown: %v", err)
		}
	}
	_ = ipCmd("ip", "link", "del", l.linkName(-1, linkBroker, 'h'))
}

// listen is kfake's listen function: every broker on the brokers' address.
func (l *netLab) listen(network, address string) (net.Listener, error) {
	_, port, err := net.SplitHostPort(address)
	if err != nil {
		return nil, err
	}
	return net.Listen(network, net.JoinHostPort(l.brokerHost(), port))
}

// command runs a relay in slot's namespace.
func (l *netLab) command(slot int, bin string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", l.nsName(slot), bin}, args...)...)
}

// dbDSN forwards slot's database link to the server of dsn and returns
// the DSN the relay in slot uses: the forwarder's address.
func (l *netLab) dbDSN(dsn string) (func(slot int) string, error) {
	host, port := "127.0.0.1", "5432"
	var rest []string
	for _, kv := range strings.Fields(dsn) {
		switch {
		case strings.HasPrefix(kv, "host="):
			host = strings.TrimPrefix(kv, "host=")
		case strings.HasPrefix(kv, "port="):
			port = strings.TrimPrefix(kv, "port=")
		default:
			rest = append(rest, kv)
		}
	}
	upstream := net.JoinHostPort(host, port)
	dsns := make([]string, l.slots)
	for s := range l.slots {
		f, err := newForwarder(net.JoinHostPort(l.hostAddr(s, linkDB), "0"), upstream)
		if err != nil {
			return nil, err
		}
		l.mu.Lock()
		l.proxies = append(l.proxies, f)
		l.mu.Unlock()
		h, p, _ := net.SplitHostPort(f.ln.Addr().String())
		dsns[s] = strings.Join(append([]string{"host=" + h, "port=" + p}, rest...), " ")
	}
	return func(slot int) string { return dsns[slot] }, nil
}

// ---------------------------------------------------------------------------
// Faults on the links

// qdisc sets the root qdisc of one end of slot's link: the root end
// ('h', egress towards the relay) or the namespace's ('n', egress from
// the relay). spec nil removes it.
func (l *netLab) qdisc(slot int, k linkKind, side byte, specs ...[]string) error {
	if k == linkBroker && l.brokerLinks > 0 {
		for i := range l.brokerLinks {
			if err := l.qdisc(slot, linkToBroker+linkKind(i), side, specs...); err != nil {
				return err
			}
		}
		return nil
	}
	dev := l.linkName(slot, k, side)
	tc := []string{"tc"}
	if side == 'n' {
		tc = append(tc, "-n", l.nsName(slot))
	}
	del := append(append([]string{}, tc...), "qdisc", "del", "dev", dev, "root")
	if err := ipCmd(del...); err != nil && !strings.Contains(err.Error(), "handle of zero") &&
		!strings.Contains(err.Error(), "No such file") && !strings.Contains(err.Error(), "Invalid handle") {
		return err
	}
	for _, spec := range specs {
		args := append(append([]string{}, tc...), spec...)
		for i := range args {
			args[i] = strings.ReplaceAll(args[i], "DEV", dev)
		}
		if err := ipCmd(args...); err != nil {
			return err
		}
	}
	return nil
}

// dropAll drops every packet: a bucket smaller than any packet.
var dropAll = []string{"qdisc", "add", "dev", "DEV", "root", "tbf", "rate", "1kbit", "burst", "1", "limit", "1"}

// partition drops everything both ways on slot's link.
func (l *netLab) partition(slot int, k linkKind) error {
	if err := l.qdisc(slot, k, 'h', dropAll); err != nil {
		return err
	}
	return l.qdisc(slot, k, 'n', dropAll)
}

// delay slows one direction of slot's link: netem's fixed delay, or
// without netem a tbf at rate kbit/s that queues up to two seconds.
func (l *netLab) delay(slot int, k linkKind, side byte, d time.Duration, rateKbit int) (string, error) {
	if l.netem {
		ms := strconv.Itoa(int(d.Milliseconds())) + "ms"
		return "netem delay " + ms, l.qdisc(slot, k, side, []string{"qdisc", "add", "dev", "DEV", "root", "netem", "delay", ms})
	}
	rate := strconv.Itoa(rateKbit) + "kbit"
	return "tbf " + rate + " queue 2s", l.qdisc(slot, k, side,
		[]string{"qdisc", "add", "dev", "DEV", "root", "tbf", "rate", rate, "burst", "1600", "latency", "2s"})
}

// loss drops a share of the packets one way on slot's link: netem's
// random loss of pct percent, or without netem every 2^shift-th IP packet
// by its identification (shift 2, 3, 4: 25%, 12.5%, 6.25%).
func (l *netLab) loss(slot int, k linkKind, side byte, pct, shift int) (string, error) {
	if l.netem {
		p := strconv.Itoa(pct) + "%"
		return "netem loss " + p, l.qdisc(slot, k, side, []string{"qdisc", "add", "dev", "DEV", "root", "netem", "loss", p})
	}
	mask := "0x" + strconv.FormatInt(int64(1)<<shift-1, 16)
	return fmt.Sprintf("every %dth IP packet (%.2f%%)", 1<<shift, 100/float64(int(1)<<shift)), l.qdisc(slot, k, side,
		[]string{"qdisc", "add", "dev", "DEV", "root", "handle", "1:", "htb", "default", "10"},
		[]string{"class", "add", "dev", "DEV", "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"},
		[]string{"class", "add", "dev", "DEV", "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit"},
		[]string{"qdisc", "add", "dev", "DEV", "parent", "1:20", "handle", "20:", "tbf", "rate", "1kbit", "burst", "1", "limit", "1"},
		[]string{"filter", "add", "dev", "DEV", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
			"match", "u16", "0", mask, "at", "4", "flowid", "1:20"},
	)
}

// heal removes every fault on slot's link.
func (l *netLab) heal(slot int, k linkKind) error {
	if err := l.qdisc(slot, k, 'h'); err != nil {
		return err
	}
	return l.qdisc(slot, k, 'n')
}

// qdiscsLeft lists the qdiscs the test set that are still in place.
func (l *netLab) qdiscsLeft() []string {
	var left []string
	for s := range l.slots {
		for _, k := range l.kinds() {
			for _, side := range []byte{'h', 'n'} {
				args := []string{"tc"}
				if side == 'n' {
					args = append(args, "-n", l.nsName(s))
				}
				out, err := exec.Command(args[0], append(args[1:], "qdisc", "show", "dev", l.linkName(s, k, side))...).Output()
				if err == nil && (strings.Contains(string(out), "tbf") || strings.Contains(string(out), "htb") || strings.Contains(string(out), "netem")) {
					left = append(left, l.linkName(s, k, side)+": "+strings.TrimSpace(string(out)))
				}
			}
		}
	}
	return left
}

// ---------------------------------------------------------------------------
// The database forwarder

// forwarder accepts connections on a link's root end and copies them to
// the database on loopback.
type forwarder struct {
	ln       net.Listener
	upstream string
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    map[net.Conn]struct{}
	closed   bool
}

func newForwarder(listen, upstream string) (*forwarder, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, err
	}
	f := &forwarder{ln: ln, upstream: upstream, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.accept()
	return f, nil
}

func (f *forwarder) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		c.Close()
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *forwarder) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

func (f *forwarder) accept() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		if !f.track(c) {
			return
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer f.untrack(c)
			up, err := net.DialTimeout("tcp", f.upstream, 10*time.Second)
			if err != nil {
				return
			}
			if !f.track(up) {
				return
			}
			defer f.untrack(up)
			done := make(chan struct{}, 2)
			pipe := func(dst, src net.Conn) {
				_, _ = io.Copy(dst, src)
				// One direction ended: end both, as a connection does.
				dst.Close()
				src.Close()
				done <- struct{}{}
			}
			go pipe(up, c)
			go pipe(c, up)
			<-done
			<-done
		}()
	}
}

func (f *forwarder) close() {
	f.mu.Lock()
	f.closed = true
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	if err := f.ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		return
	}
	f.wg.Wait()
}
