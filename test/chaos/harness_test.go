package chaos_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
	"gorm.io/gorm"
)

// This file holds the machinery of the chaos test: the relay processes,
// the fault injector and the event log. chaos_test.go holds the test.

// ---------------------------------------------------------------------------
// Building the relay command

var (
	buildOnce sync.Once
	buildBin  string
	buildErr  error
	buildDur  time.Duration
)

// relayBinary builds test/chaos/cmd/chaos-relay once per test binary. It
// is built with -race when this test binary is, so that the packages come
// from the build cache that compiling this test filled (only the main
// package is compiled and linked), and so that the relays themselves run
// under the race detector in CI.
func relayBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		start := time.Now()
		dir, err := os.MkdirTemp("", "chaos-relay-")
		if err != nil {
			buildErr = err
			return
		}
		buildBin = filepath.Join(dir, "chaos-relay")
		args := []string{"build", "-o", buildBin}
		if raceEnabled {
			args = append(args, "-race")
		}
		args = append(args, "github.com/gorm-outbox/outbox/test/chaos/cmd/chaos-relay")
		cmd := exec.Command(goTool(), args...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
		}
		buildDur = time.Since(start)
	})
	require.NoError(t, buildErr, "build the relay command")
	return buildBin
}

// goTool returns the go command: the one on PATH, else the one of the
// toolchain that built this test.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return filepath.Join(runtime.GOROOT(), "bin", "go")
}

// ---------------------------------------------------------------------------
// Events

// event is one injected fault, or something the relays logged that
// explains an anomaly (a takeover under an in-flight publish).
type event struct {
	Kind  string
	Slot  int // relay slot, -1 when not about one relay
	Start time.Time
	End   time.Time
	Note  string
}

type eventLog struct {
	mu     sync.Mutex
	events []event
	counts map[string]int
}

func (l *eventLog) add(e event) *event {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e.End.IsZero() {
		e.End = e.Start
	}
	l.events = append(l.events, e)
	if l.counts == nil {
		l.counts = map[string]int{}
	}
	l.counts[e.Kind]++
	return &l.events[len(l.events)-1]
}

// end sets the end of the most recent event of kind for slot.
func (l *eventLog) end(kind string, slot int, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := len(l.events) - 1; i >= 0; i-- {
		if l.events[i].Kind == kind && l.events[i].Slot == slot {
			l.events[i].End = at
			return
		}
	}
}

func (l *eventLog) count(kinds ...string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, k := range kinds {
		n += l.counts[k]
	}
	return n
}

func (l *eventLog) snapshot() []event {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]event(nil), l.events...)
}

// Event kinds.
const (
	evKill          = "sigkill"
	evTerm          = "sigterm"
	evPause         = "pause"
	evBackendKill   = "backend_kill"
	evNotLeader     = "broker_not_leader"
	evTimeoutAfter  = "broker_timeout_after_write"
	evReplicasAfter = "broker_not_enough_replicas_after_append"
	evDelay         = "broker_delay"
	evDropConn      = "broker_drop_connection"
	evNodeBounce    = "broker_removed"
	evShuffle       = "broker_leader_election"
	evTakeover      = "takeover_during_publish" // from relay logs
	evFenced        = "fenced"                  // from relay logs (strict)
	evLateDelete    = "lease_lost_before_delete"
)

var brokerFaultKinds = []string{evNotLeader, evTimeoutAfter, evReplicasAfter, evDelay, evDropConn, evShuffle}

// ---------------------------------------------------------------------------
// Relay processes

type procState int

const (
	procRunning procState = iota
	procStopping
	procPaused
	procDead
)

type relayProc struct {
	slot    int
	gen     int
	id      string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed when the process exited
	state   procState
	// expectedExit is set before the harness kills or stops the process;
	// an exit without it is a failure of the relay.
	expectedExit bool
	exitErr      error
	isReady      bool
}

// relayArgs configures every relay process.
type relayArgs struct {
	bin     string
	dsn     string // of the test's schema; application_name is appended
	tag     string // unique to the run: relays' application_name is tag-slot
	brokers func() []string
	flags   []string
	logDir  string
	// With net set, each relay runs in its slot's network namespace and
	// reaches the database through its slot's link.
	net *netLab
	// dsnFor is the DSN of slot, when it is not dsn.
	dsnFor func(slot int) string
}

// procs manages the relay slots. All its methods run on one goroutine at
// a time: the chaos loop during the run, the test goroutine before and
// after it.
type procs struct {
	t     *testing.T
	args  relayArgs
	slots []*relayProc
	log   *eventLog

	mu         sync.Mutex
	unexpected []string // relays that exited without being told to
	allLogs    []string
	// exits are the times from SIGTERM to process exit.
	exits []time.Duration
}

// termTimeout bounds a graceful stop: SIGTERM to process exit. The relay
// gives its in-flight batch 10s (-stop-timeout), then the Kafka publisher's
// Close flushes what is still in flight, bounded only by the producer's
// retries and timeouts (publisher.Kafka.Close takes no deadline). A
// process that takes longer is counted as hung.
const termTimeout = 2 * time.Minute

// slowExit is a graceful exit worth reporting.
const slowExit = 15 * time.Second

func (p *procs) noteExit(d time.Duration) {
	p.mu.Lock()
	p.exits = append(p.exits, d)
	p.mu.Unlock()
}

// exitStats returns how many graceful exits took longer than slowExit and
// the longest.
func (p *procs) exitStats() (slow int, longest time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range p.exits {
		if d > slowExit {
			slow++
		}
		longest = max(longest, d)
	}
	return slow, longest
}

// appName is the application_name of a relay slot's database sessions:
// the run's unique tag (its schema) and the slot, so that concurrent runs
// (the two modes run in parallel) never terminate each other's backends.
func (p *procs) appName(slot int) string { return p.args.tag + "-" + strconv.Itoa(slot) }

func (p *procs) start(slot int) *relayProc {
	p.t.Helper()
	gen := 0
	if old := p.slots[slot]; old != nil {
		gen = old.gen + 1
	}
	rp := &relayProc{
		slot:    slot,
		gen:     gen,
		id:      fmt.Sprintf("chaos-%d-%d", slot, gen),
		logPath: filepath.Join(p.args.logDir, fmt.Sprintf("relay-%d-%d.log", slot, gen)),
		done:    make(chan struct{}),
	}
	logFile, err := os.Create(rp.logPath)
	require.NoError(p.t, err)
	flags := append([]string{"-id", rp.id, "-brokers", strings.Join(p.args.brokers(), ",")}, p.args.flags...)
	cmd := exec.Command(p.args.bin, flags...)
	dsn := p.args.dsn
	if p.args.net != nil {
		cmd = p.args.net.command(slot, p.args.bin, flags...)
		dsn = p.args.dsnFor(slot)
	}
	cmd.Env = append(os.Environ(), "CHAOS_DSN="+dsn+" application_name="+p.appName(slot),
		// Under -race, a race report must not change the exit status: the
		// test reads the reports from the log and fails on those in this
		// module's code (see scanRelayLogs).
		"GORACE=exitcode=0 halt_on_error=0")
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// The relays die with the test process, whatever kills it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(p.t, cmd.Start(), "start relay %s", rp.id)
	rp.cmd = cmd
	p.slots[slot] = rp
	p.mu.Lock()
	p.allLogs = append(p.allLogs, rp.logPath)
	p.mu.Unlock()
	go func() {
		err := cmd.Wait()
		logFile.Close()
		rp.exitErr = err
		close(rp.done)
	}()
	return rp
}

// ready reports whether the relay has started (its log says so). Before
// that, its SIGTERM handler may not be installed yet: the Go runtime and
// package initialisation (slow under -race) come first, and a SIGTERM
// then kills the process.
func (rp *relayProc) ready() bool {
	if rp.isReady {
		return true
	}
	b, err := os.ReadFile(rp.logPath)
	rp.isReady = err == nil && strings.Contains(string(b), `"chaos-relay: started"`)
	return rp.isReady
}

// waitReady waits up to d for the relay to start.
func (rp *relayProc) waitReady(d time.Duration) {
	deadline := time.Now().Add(d)
	for !rp.ready() && !rp.exited() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
}

func (rp *relayProc) exited() bool {
	select {
	case <-rp.done:
		return true
	default:
		return false
	}
}

// reap records relays that exited on their own.
func (p *procs) reap() {
	for _, rp := range p.slots {
		if rp == nil || rp.state == procDead || !rp.exited() {
			continue
		}
		rp.state = procDead
		if !rp.expectedExit {
			p.mu.Lock()
			p.unexpected = append(p.unexpected, fmt.Sprintf("relay %s exited by itself (%v); log %s:\n%s",
				rp.id, rp.exitErr, rp.logPath, tail(rp.logPath, 15)))
			p.mu.Unlock()
		}
	}
}

func (p *procs) kill(rp *relayProc) {
	rp.expectedExit = true
	_ = rp.cmd.Process.Signal(syscall.SIGKILL)
	if rp.state == procPaused {
		_ = rp.cmd.Process.Signal(syscall.SIGCONT)
	}
	<-rp.done
	rp.state = procDead
}

func (p *procs) term(rp *relayProc) {
	rp.expectedExit = true
	rp.state = procStopping
	_ = rp.cmd.Process.Signal(syscall.SIGTERM)
}

// stopAll stops every relay gracefully, killing those that do not exit
// within the timeout, and reports the ones that did not exit 0.
func (p *procs) stopAll(timeout time.Duration) []string {
	var bad []string
	for _, rp := range p.slots {
		if rp == nil || rp.state == procDead {
			continue
		}
		if rp.state == procPaused {
			_ = rp.cmd.Process.Signal(syscall.SIGCONT)
		}
		rp.waitReady(30 * time.Second)
		p.term(rp)
	}
	start := time.Now()
	deadline := time.After(timeout)
	for _, rp := range p.slots {
		if rp == nil || rp.state == procDead {
			continue
		}
		select {
		case <-rp.done:
			p.noteExit(time.Since(start))
			if rp.exitErr != nil {
				bad = append(bad, fmt.Sprintf("relay %s: graceful stop exited with %v; log tail:\n%s", rp.id, rp.exitErr, tail(rp.logPath, 10)))
			}
		case <-deadline:
			bad = append(bad, fmt.Sprintf("relay %s: no exit within %s of SIGTERM; killed", rp.id, timeout))
			p.kill(rp)
		}
		rp.state = procDead
	}
	return bad
}

// killAll is the cleanup of last resort.
func (p *procs) killAll() {
	for _, rp := range p.slots {
		if rp != nil && rp.state != procDead && !rp.exited() {
			p.kill(rp)
		} else if rp != nil {
			<-rp.done
		}
	}
}

func (p *procs) logs() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.allLogs...)
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// relayLogStats scans the relays' JSON logs for the events that explain
// duplicates and reordering, and counts errors.
type relayLogStats struct {
	takeovers      []time.Time // publish given up because the lease was lost or untrusted
	explainers     []time.Time // other lines that announce a takeover
	lateDeletes    []time.Time // acknowledged, but the delete was refused: republished
	fenced         []time.Time
	publishFailed  int
	storeErrors    int
	leaseChanges   int
	unexpectedErrs []string // error-level lines that are not the relay's expected complaints
	// Data races the race detector reported in the relays: those with an
	// access in this module's code, and those entirely in dependencies.
	ourRaces, depRaces []string
}

// ourModule prefixes the functions of this module in a race report.
const ourModule = "github.com/gorm-outbox/outbox"

// classifyRace reports whether a race report has one of its two accesses
// in this module's code: the first frame after an access header ("Write
// at", "Previous read at", ...).
func classifyRace(report []string) bool {
	for i, l := range report {
		if (strings.HasPrefix(l, "Write at") || strings.HasPrefix(l, "Read at") ||
			strings.HasPrefix(l, "Previous write at") || strings.HasPrefix(l, "Previous read at")) && i+1 < len(report) {
			if strings.HasPrefix(strings.TrimSpace(report[i+1]), ourModule) {
				return true
			}
		}
	}
	return false
}

// raceSummary is a race report shortened to its two accesses' top frames.
func raceSummary(report []string) string {
	var parts []string
	for i, l := range report {
		if strings.Contains(l, " at 0x") && i+2 < len(report) {
			parts = append(parts, strings.TrimSpace(report[i+1])+" "+strings.TrimSpace(report[i+2]))
		}
	}
	return strings.Join(parts, " vs ")
}

func scanRelayLogs(paths []string) relayLogStats {
	var s relayLogStats
	var (
		race     []string // the race report being read, if any
		lastPath string
	)
	eachLogLine(paths, func(p, text string) bool {
		if p != lastPath {
			race, lastPath = nil, p
		}
		switch {
		case text == "WARNING: DATA RACE":
			race = []string{}
			return true
		case race != nil && text == "==================":
			if classifyRace(race) {
				s.ourRaces = append(s.ourRaces, filepath.Base(p)+": "+strings.Join(race, "\n"))
			} else {
				s.depRaces = append(s.depRaces, filepath.Base(p)+": "+raceSummary(race))
			}
			race = nil
			return true
		case race != nil:
			race = append(race, text)
			return true
		}
		var line struct {
			Time  time.Time `json:"time"`
			Level string    `json:"level"`
			Msg   string    `json:"msg"`
			Err   string    `json:"err"`
		}
		if json.Unmarshal([]byte(text), &line) != nil {
			return true // a line cut by SIGKILL
		}
		switch {
		case strings.Contains(line.Msg, "lease lost during publish"):
			s.takeovers = append(s.takeovers, line.Time)
		case strings.Contains(line.Msg, "lease deadline passed during publish"):
			s.explainers = append(s.explainers, line.Time)
		case strings.Contains(line.Msg, "lease lost before delete"):
			s.lateDeletes = append(s.lateDeletes, line.Time)
		case strings.Contains(line.Msg, "fenced"):
			s.fenced = append(s.fenced, line.Time)
		case strings.Contains(line.Msg, "relay: publish failed"):
			s.publishFailed++
		case strings.Contains(line.Msg, "failed") && line.Level == "WARN":
			s.storeErrors++
		case strings.Contains(line.Msg, "leases changed"):
			s.leaseChanges++
		}
		if line.Level == "ERROR" && !strings.Contains(line.Msg, "chaos-relay: stop") {
			s.unexpectedErrs = append(s.unexpectedErrs, filepath.Base(p)+": "+line.Msg+": "+line.Err)
		}
		return true
	})
	return s
}

// ---------------------------------------------------------------------------
// Faults

// injector injects faults at random. It runs on its own goroutine (run)
// and owns procs while it runs.
type injector struct {
	t     *testing.T
	rng   *rand.Rand
	procs *procs
	fake  *kfake.Cluster // nil on Apache Kafka
	real  *realBrokers   // nil on kfake
	net   *netInjector   // network faults only, when set
	pg    *pgRestarter   // PostgreSQL restarts only, when set
	// kinds, when set, replaces the fault kinds inject draws from.
	kinds func(in *injector) []action
	// partitions of the topic
	partitions int32
	db         *gorm.DB // for pg_terminate_backend
	log        *eventLog
	lease      time.Duration
	every      time.Duration

	pending  []scheduled
	handles  []*kfake.FaultHandle
	controls []*control
	round    []int    // kinds still to inject in the first round
	delaying *control // the delay in progress, if any
	removed  *removedNode
	nodeIDs  map[string]int32 // broker address -> node id
	backends int              // backends terminated
}

type scheduled struct {
	at time.Time
	fn func()
}

type removedNode struct {
	node int32
	port int
}

// control is a ControlKey function the injector can switch off.
type control struct {
	mu  sync.Mutex
	off bool
}

func (c *control) disable() { c.mu.Lock(); c.off = true; c.mu.Unlock() }
func (c *control) isOff() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.off
}

func (in *injector) after(d time.Duration, fn func()) {
	in.pending = append(in.pending, scheduled{at: time.Now().Add(d), fn: fn})
}

func (in *injector) jitter(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(in.rng.Int64N(int64(hi-lo)+1))
}

// runDue runs the scheduled actions that are due; with all set, it waits
// for and runs every one of them, including those they schedule.
func (in *injector) runDue(all bool) {
	for {
		in.procs.reap()
		now := time.Now()
		var due, keep []scheduled
		for _, s := range in.pending {
			if now.Before(s.at) {
				keep = append(keep, s)
			} else {
				due = append(due, s)
			}
		}
		in.pending = keep
		for _, s := range due {
			s.fn() // may schedule more
		}
		if !all || len(in.pending) == 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// run injects faults until stop is closed, then heals everything: every
// scheduled restart and resume runs, broker faults are removed, a removed
// broker is added back, and every relay slot has a running relay.
func (in *injector) run(stop <-chan struct{}) {
	tick := time.NewTimer(in.jitter(in.every/2, in.every*3/2))
	defer tick.Stop()
	poll := time.NewTicker(25 * time.Millisecond)
	defer poll.Stop()
	for {
		select {
		case <-stop:
			in.heal()
			return
		case <-poll.C:
			in.runDue(false)
		case <-tick.C:
			in.inject()
			tick.Reset(in.jitter(in.every/2, in.every*3/2))
		}
	}
}

type action struct {
	weight int
	fn     func() bool // false: not applicable now, try another
}

func (in *injector) inject() {
	actions := []action{
		{3, in.sigkill},
		{2, in.sigterm},
		{2, in.pause},
		{3, in.killBackends},
	}
	if in.kinds != nil {
		actions = in.kinds(in)
	} else if in.net != nil {
		actions = in.net.actions(in)
	} else if in.pg != nil {
		actions = in.pg.actions(in)
	} else if in.real != nil {
		actions = append(actions, in.real.actions(in)...)
	} else {
		actions = append(actions,
			// Counts above the relay's producer retries (5) make a publish
			// fail: the relay's own backoff and retry path.
			action{2, in.brokerFault(evNotLeader, kerr.NotLeaderForPartition, 1, 12)},
			action{2, in.brokerFault(evTimeoutAfter, kerr.RequestTimedOut, 1, 8)},
			action{1, in.brokerFault(evReplicasAfter, kerr.NotEnoughReplicasAfterAppend, 1, 8)},
			action{2, in.delay},
			action{1, in.dropConnection},
			action{1, in.bounceNode},
			action{1, in.shuffleLeaders},
		)
	}
	// The first faults go through every kind once, in random order, so
	// that every run covers them all; then kinds are drawn by weight.
	if in.round == nil {
		in.round = in.rng.Perm(len(actions))
	}
	for len(in.round) > 0 {
		a := actions[in.round[0]]
		in.round = in.round[1:]
		if a.fn() {
			return
		}
	}
	total := 0
	for _, a := range actions {
		total += a.weight
	}
	for range 10 {
		n := in.rng.IntN(total)
		for _, a := range actions {
			if n < a.weight {
				if a.fn() {
					return
				}
				break
			}
			n -= a.weight
		}
	}
}

// running returns a random relay slot whose process runs and has
// started, or nil.
func (in *injector) running() *relayProc {
	in.procs.reap()
	var live []*relayProc
	for _, rp := range in.procs.slots {
		if rp != nil && rp.state == procRunning && rp.ready() {
			live = append(live, rp)
		}
	}
	if len(live) == 0 {
		return nil
	}
	return live[in.rng.IntN(len(live))]
}

// alive counts relays that run or will resume.
func (in *injector) alive() int {
	n := 0
	for _, rp := range in.procs.slots {
		if rp != nil && (rp.state == procRunning || rp.state == procPaused) {
			n++
		}
	}
	return n
}

func (in *injector) restartLater(slot int, d time.Duration) {
	in.after(d, func() { in.procs.start(slot) })
}

func (in *injector) sigkill() bool {
	rp := in.running()
	if rp == nil {
		return false
	}
	now := time.Now()
	in.procs.kill(rp)
	in.log.add(event{Kind: evKill, Slot: rp.slot, Start: now})
	in.restartLater(rp.slot, in.jitter(100*time.Millisecond, 1500*time.Millisecond))
	return true
}

func (in *injector) sigterm() bool {
	rp := in.running()
	if rp == nil {
		return false
	}
	now := time.Now()
	in.procs.term(rp)
	in.log.add(event{Kind: evTerm, Slot: rp.slot, Start: now})
	var wait func()
	deadline := now.Add(termTimeout)
	wait = func() {
		switch {
		case rp.exited():
			rp.state = procDead
			in.log.end(evTerm, rp.slot, time.Now())
			in.procs.noteExit(time.Since(now))
			if rp.exitErr != nil {
				in.procs.mu.Lock()
				in.procs.unexpected = append(in.procs.unexpected, fmt.Sprintf("relay %s: graceful stop exited with %v; log tail:\n%s",
					rp.id, rp.exitErr, tail(rp.logPath, 10)))
				in.procs.mu.Unlock()
			}
			in.restartLater(rp.slot, in.jitter(50*time.Millisecond, 800*time.Millisecond))
		case time.Now().After(deadline):
			in.procs.mu.Lock()
			in.procs.unexpected = append(in.procs.unexpected, fmt.Sprintf("relay %s: no exit within %s of SIGTERM; log tail:\n%s",
				rp.id, termTimeout, tail(rp.logPath, 10)))
			in.procs.mu.Unlock()
			in.procs.kill(rp)
			in.restartLater(rp.slot, 0)
		default:
			in.after(50*time.Millisecond, wait)
		}
	}
	in.after(50*time.Millisecond, wait)
	return true
}

// pause stops a relay (SIGSTOP) for longer than its lease, so that a peer
// takes its buckets over while it is frozen, possibly mid-publish, and
// resumes it (SIGCONT).
func (in *injector) pause() bool {
	for _, rp := range in.procs.slots {
		if rp != nil && rp.state == procPaused {
			return false // one at a time
		}
	}
	rp := in.running()
	if rp == nil {
		return false
	}
	d := in.lease + in.jitter(in.lease/4, in.lease)
	now := time.Now()
	if err := rp.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return false
	}
	rp.state = procPaused
	in.log.add(event{Kind: evPause, Slot: rp.slot, Start: now, End: now.Add(d), Note: d.String()})
	in.after(d, func() { in.resume(rp) })
	return true
}

func (in *injector) resume(rp *relayProc) {
	if rp.state != procPaused {
		return
	}
	_ = rp.cmd.Process.Signal(syscall.SIGCONT)
	rp.state = procRunning
	in.log.end(evPause, rp.slot, time.Now())
}

// killBackends terminates the database backends of one relay, found by the
// application_name of its DSN; sometimes of all relays at once.
func (in *injector) killBackends() bool {
	slot, name := -1, in.procs.args.tag+"-%"
	if in.rng.IntN(4) > 0 {
		rp := in.running()
		if rp == nil {
			return false
		}
		slot, name = rp.slot, in.procs.appName(rp.slot)
	}
	var killed []bool
	err := in.db.Raw("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE ? AND pid <> pg_backend_pid()", name).
		Scan(&killed).Error
	if err != nil {
		in.t.Logf("chaos: pg_terminate_backend: %v", err)
		return false
	}
	n := 0
	for _, k := range killed {
		if k {
			n++
		}
	}
	in.backends += n
	in.log.add(event{Kind: evBackendKill, Slot: slot, Start: time.Now(), Note: strconv.Itoa(n)})
	return true
}

func (in *injector) brokerFault(kind string, code *kerr.Error, lo, hi int) func() bool {
	return func() bool {
		n := lo + in.rng.IntN(hi-lo+1)
		h := in.fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: code, Count: n})
		in.handles = append(in.handles, h)
		in.log.add(event{Kind: kind, Slot: -1, Start: time.Now(), End: time.Now().Add(2 * time.Second), Note: fmt.Sprintf("%s x%d", code.Message, n)})
		return true
	}
}

// delay stalls the cluster while it handles the next produce request, for
// up to one and a half leases: the records are written late, and the
// relay that sent them may have lost its buckets meanwhile (its lease
// renewals keep working, so mostly it has not).
//
// kfake's SleepControl would stall one connection only, but it has a data
// race (kfake cluster.go, bsleep.waitQueue vs bsleep.enqueue) that fails
// this test under -race; a control function that blocks stalls every
// broker instead, like a cluster-wide pause. So one delay at a time, one
// request each: stalls stacked back to back would stop the cluster for
// good (every queued request stalled in turn, every client timing out and
// sending more).
func (in *injector) delay() bool {
	if in.delaying != nil && !in.delaying.isOff() {
		return false
	}
	d := in.jitter(200*time.Millisecond, 3*in.lease/2)
	c := &control{}
	in.controls = append(in.controls, c)
	in.delaying = c
	fake := in.fake
	fake.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		if c.isOff() {
			fake.DropControl()
			return nil, nil, false
		}
		deadline := time.Now().Add(d)
		for time.Now().Before(deadline) && !c.isOff() {
			time.Sleep(20 * time.Millisecond)
		}
		c.disable() // one request only
		fake.DropControl()
		return nil, nil, false // then the broker handles it normally
	})
	now := time.Now()
	in.log.add(event{Kind: evDelay, Slot: -1, Start: now, End: now.Add(d + time.Second), Note: d.String()})
	return true
}

// dropConnection closes the connection of the next produce request without
// answering it; the records are not written.
func (in *injector) dropConnection() bool {
	c := &control{}
	in.controls = append(in.controls, c)
	fake := in.fake
	fake.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		if c.isOff() {
			fake.DropControl()
			return nil, nil, false
		}
		return nil, errors.New("chaos: connection dropped"), true
	})
	in.log.add(event{Kind: evDropConn, Slot: -1, Start: time.Now(), End: time.Now().Add(time.Second)})
	return true
}

// bounceNode removes a broker from the cluster (its partitions move to the
// others) and adds it back later on the same port.
func (in *injector) bounceNode() bool {
	if in.removed != nil {
		return false
	}
	addrs := in.fake.ListenAddrs()
	if len(addrs) < 2 {
		return false
	}
	i := in.rng.IntN(len(addrs))
	_, portText, _ := strings.Cut(addrs[i], ":")
	port, _ := strconv.Atoi(portText)
	node := in.nodeOnPort(port)
	if node < 0 {
		return false
	}
	if err := in.fake.RemoveNode(node); err != nil {
		in.t.Logf("chaos: remove node %d: %v", node, err)
		return false
	}
	in.removed = &removedNode{node: node, port: port}
	d := in.jitter(time.Second, 3*time.Second)
	now := time.Now()
	in.log.add(event{Kind: evNodeBounce, Slot: -1, Start: now, End: now.Add(d), Note: fmt.Sprintf("node %d", node)})
	in.after(d, in.readdNode)
	return true
}

// nodeOnPort finds the node id of the broker listening on port.
func (in *injector) nodeOnPort(port int) int32 {
	for addr, id := range in.nodeIDs {
		if strings.HasSuffix(addr, ":"+strconv.Itoa(port)) {
			return id
		}
	}
	return -1
}

func (in *injector) readdNode() {
	if in.removed == nil {
		return
	}
	r := in.removed
	id, port, err := in.fake.AddNode(r.node, r.port)
	if err != nil {
		// The port may not be reusable yet; any port will do, the relays
		// learn brokers from metadata.
		id, port, err = in.fake.AddNode(r.node, 0)
	}
	if err != nil {
		in.t.Logf("chaos: add node %d back: %v", r.node, err)
		in.after(500*time.Millisecond, in.readdNode)
		return
	}
	for addr, old := range in.nodeIDs {
		if old == id {
			delete(in.nodeIDs, addr)
		}
	}
	in.nodeIDs["127.0.0.1:"+strconv.Itoa(port)] = id
	in.removed = nil
	in.log.end(evNodeBounce, -1, time.Now())
}

func (in *injector) shuffleLeaders() bool {
	in.fake.ShufflePartitionLeaders()
	in.log.add(event{Kind: evShuffle, Slot: -1, Start: time.Now(), End: time.Now().Add(time.Second)})
	return true
}

// heal undoes every fault and makes sure every relay slot runs.
func (in *injector) heal() {
	for _, h := range in.handles {
		h.Remove()
	}
	for _, c := range in.controls {
		c.disable()
	}
	in.runDue(true)
	if in.removed != nil {
		in.readdNode()
		in.runDue(true)
	}
	if in.real != nil {
		in.real.heal(in)
	}
	if in.net != nil {
		in.net.healAll(in)
	}
	for _, rp := range in.procs.slots {
		if rp.state == procPaused {
			in.resume(rp)
		}
	}
	in.procs.reap()
	for slot, rp := range in.procs.slots {
		if rp.state == procDead {
			in.procs.start(slot)
		}
	}
}

// relayLinesSince returns the relays' log lines at Warn or above written at
// or after since, at most limit of them, each prefixed with its file: what
// the relays said while they did not make progress, for a failed liveness
// bound (the log directory is gone once the test ends).
func relayLinesSince(paths []string, since time.Time, limit int) []string {
	var out []string
	eachLogLine(paths, func(path, text string) bool {
		var line struct {
			Time  time.Time `json:"time"`
			Level string    `json:"level"`
		}
		if json.Unmarshal([]byte(text), &line) != nil {
			return true // race reports and other stderr text
		}
		if line.Level == "INFO" || line.Level == "DEBUG" || line.Time.Before(since) {
			return true
		}
		if len(text) > 600 {
			text = text[:600] + "…"
		}
		out = append(out, filepath.Base(path)+": "+text)
		return len(out) < limit
	})
	return out
}

// eachLogLine calls fn with each line of the log files at paths, in turn,
// until fn returns false; files that cannot be opened are skipped.
func eachLogLine(paths []string, fn func(path, text string) bool) {
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		more := true
		for more && sc.Scan() {
			more = fn(p, sc.Text())
		}
		_ = f.Close()
		if !more {
			return
		}
	}
}
