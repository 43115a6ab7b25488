package main

import (
	"bufio"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// runMainEnv makes the test binary run the service's main instead of the
// tests: the process tests start the real command this way, with real
// signals, without building a second binary.
const runMainEnv = "GIN_ORDERS_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// processDeadline bounds every wait on the child process. It is a polling
// deadline for a hung process, far above the times the tests log.
const processDeadline = time.Minute

// service is the gin-orders command running as a child process.
type service struct {
	t      *testing.T
	cmd    *exec.Cmd
	mu     sync.Mutex
	lines  []string
	exited chan struct{}
	state  *os.ProcessState
}

// startService runs main in a child process with args; its log (stderr)
// is collected line by line.
func startService(t *testing.T, args ...string) *service {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	cmd.Dir = t.TempDir()
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	s := &service{t: t, cmd: cmd, exited: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			s.mu.Lock()
			s.lines = append(s.lines, sc.Text())
			s.mu.Unlock()
		}
		_ = cmd.Wait() // after every read from the pipe, as exec requires
		s.mu.Lock()
		s.state = cmd.ProcessState
		s.mu.Unlock()
		close(s.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-s.exited:
		default:
			_ = cmd.Process.Kill()
			<-s.exited
		}
		if t.Failed() {
			t.Logf("service log:\n%s", s.log())
		}
	})
	return s
}

func (s *service) log() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.lines, "\n")
}

// waitLog waits for a log line containing every one of parts and returns it.
func (s *service) waitLog(parts ...string) string {
	s.t.Helper()
	var found string
	require.EventuallyWithT(s.t, func(c *assert.CollectT) {
		s.mu.Lock()
		defer s.mu.Unlock()
	lines:
		for _, l := range s.lines {
			for _, p := range parts {
				if !strings.Contains(l, p) {
					continue lines
				}
			}
			found = l
			return
		}
		c.Errorf("no log line with %q yet", parts)
	}, processDeadline, 20*time.Millisecond)
	return found
}

// addr returns the HTTP address the service logged.
func (s *service) addr() string {
	s.t.Helper()
	return logAttr(s.t, s.waitLog(`msg="gin-orders listening"`), "addr")
}

func (s *service) signal(sig os.Signal) time.Time {
	s.t.Helper()
	require.NoError(s.t, s.cmd.Process.Signal(sig))
	return time.Now()
}

// waitExit waits for the process to exit and returns its exit code (-1
// when a signal ended it).
func (s *service) waitExit() int {
	s.t.Helper()
	require.EventuallyWithT(s.t, func(c *assert.CollectT) {
		select {
		case <-s.exited:
		default:
			c.Errorf("the service is still running")
		}
	}, processDeadline, 10*time.Millisecond)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.state.ExitCode()
}

var attrRE = regexp.MustCompile(`(?:^| )([a-z_]+)=("(?:[^"\\]|\\.)*"|\S*)`)

// logAttr returns the value of key in a slog text line.
func logAttr(t *testing.T, line, key string) string {
	t.Helper()
	for _, m := range attrRE.FindAllStringSubmatch(line, -1) {
		if m[1] == key {
			if v, err := strconv.Unquote(m[2]); err == nil {
				return v
			}
			return m[2]
		}
	}
	t.Fatalf("no %s in log line %q", key, line)
	return ""
}

func postOrder(t *testing.T, addr string) {
	t.Helper()
	resp, err := http.Post("http://"+addr+"/orders", "application/json", strings.NewReader(`{"customer":"ada","total":4200}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
}

// The service with its defaults (SQLite, in-process broker, the demo
// consumer on) delivers an order's event to the consumer, and SIGINT or
// SIGTERM ends it cleanly.
func TestProcessShutsDownOnSignal(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			s := startService(t, "-addr", "127.0.0.1:0", "-kafka-brokers=",
				"-database-url", filepath.Join(t.TempDir(), "orders.db"))
			postOrder(t, s.addr())
			s.waitLog(`msg="consumer received event"`, "event_type=OrderPlaced", "key=1 ")

			sent := s.signal(sig)
			require.Equal(t, 0, s.waitExit(), "clean exit")
			t.Logf("exited %v after %v", time.Since(sent).Round(time.Millisecond), sig)
			s.waitLog(`msg="shutting down; a second signal exits at once"`)
			s.waitLog(`msg="relay: released leases"`)
			s.waitLog("msg=stopped")
		})
	}
}

// stalledBroker is a Kafka-protocol broker that holds every produce
// request until the test ends, so the service's shutdown cannot finish.
func stalledBroker(t *testing.T, topic string) (addrs string, produced <-chan struct{}) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(8, topic))
	require.NoError(t, err)
	release := make(chan struct{})
	t.Cleanup(func() {
		close(release)
		c.Close()
	})
	first := make(chan struct{})
	var once sync.Once
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		once.Do(func() { close(first) })
		c.SleepControl(func() { <-release })
		return nil, nil, false
	})
	return strings.Join(c.ListenAddrs(), ","), first
}

// A second signal ends the process at once when the first one's shutdown
// hangs (here on a publish the broker never answers); a shutdown that
// outlasts -shutdown-timeout ends it as well.
func TestProcessShutdownHangs(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout string
		second  bool
		log     string
	}{
		{"second signal", "10m", true, `msg="second signal: exiting without finishing the shutdown"`},
		{"timeout", "200ms", false, `msg="shutdown did not finish within its timeout; exiting"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			brokers, produced := stalledBroker(t, "orders")
			s := startService(t, "-addr", "127.0.0.1:0", "-kafka-brokers", brokers,
				"-database-url", filepath.Join(t.TempDir(), "orders.db"), "-shutdown-timeout", tc.timeout)
			postOrder(t, s.addr())
			select {
			case <-produced:
			case <-time.After(processDeadline):
				t.Fatal("the relay never published")
			}

			sent := s.signal(syscall.SIGINT)
			s.waitLog(`msg="shutting down; a second signal exits at once"`)
			if tc.second {
				sent = s.signal(syscall.SIGINT)
			}
			require.Equal(t, 1, s.waitExit())
			t.Logf("exited %v after the last signal", time.Since(sent).Round(time.Millisecond))
			s.waitLog(tc.log)
			require.NotContains(t, s.log(), "msg=stopped")
		})
	}
}

// After an unclean exit the restarted service (a new relay id) says whose
// leases it waits for and until when.
func TestProcessRestartAfterKill(t *testing.T) {
	t.Parallel()
	dbPath := filepath.Join(t.TempDir(), "orders.db")
	args := []string{"-addr", "127.0.0.1:0", "-kafka-brokers=", "-database-url", dbPath}
	first := startService(t, args...)
	owner := logAttr(t, first.waitLog(`msg="relay: leases changed"`, "owned=8"), "relay_id")
	killed := first.signal(syscall.SIGKILL)
	require.Equal(t, -1, first.waitExit(), "killed")

	second := startService(t, args...)
	line := second.waitLog(`msg="relay: waiting for buckets another relay holds`, "owner="+owner)
	require.Equal(t, "[0 1 2 3 4 5 6 7]", logAttr(t, line, "buckets"))
	until, err := time.Parse(time.RFC3339Nano, logAttr(t, line, "until"))
	require.NoError(t, err)
	// The killed relay renewed its leases for 30 s (relay.LeaseDurationDefault)
	// at most one renewal interval before it was killed.
	require.True(t, until.After(killed), "until %v is after the kill at %v", until, killed)
	require.False(t, until.After(killed.Add(30*time.Second)), "until %v", until)
	t.Logf("restarted relay waits until %v (%v after the kill)", until, until.Sub(killed).Round(time.Millisecond))

	second.signal(syscall.SIGINT)
	require.Equal(t, 0, second.waitExit(), fmt.Sprintf("clean exit of the restarted service:\n%s", second.log()))
}

// A relay that stops on an error ends the process with status 1 and the
// error in the log: a writer with a larger BucketCount commits to the
// service's outbox.
func TestProcessExitsWhenTheRelayFails(t *testing.T) {
	t.Parallel()
	dbPath := filepath.Join(t.TempDir(), "orders.db")
	s := startService(t, "-addr", "127.0.0.1:0", "-kafka-brokers=", "-consume=false", "-database-url", dbPath)
	s.waitLog(`msg="relay: leases changed"`, "owned=8")

	writeWithBucketCount64(t, dbPath, "orders")

	require.Equal(t, 1, s.waitExit(), "a failed relay is a failed process")
	s.waitLog(`msg="stopped on error"`, "a writer uses a BucketCount of at least")
	require.NotContains(t, s.log(), "msg=stopped\n")
}
