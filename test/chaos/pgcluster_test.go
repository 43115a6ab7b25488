package chaos_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// EnvPGRestart enables TestChaosPostgresRestart outside CI. The test runs
// a PostgreSQL cluster of its own (initdb into a temporary directory, on
// a free port), so restarting it disturbs no other test; it needs root
// (the server runs as the postgres user) and the server binaries.
const EnvPGRestart = "OUTBOX_CHAOS_PG_RESTART"

// TestChaosPostgresRestart runs the chaos suite against a PostgreSQL
// server that the injector restarts with a fast or an immediate shutdown
// (a crash: the server recovers from its WAL) while the writers and the
// relays run. It asserts what TestChaosNetwork asserts: nothing lost, no
// key reordered in either mode, progress within LeaseDuration plus three
// poll intervals after the last restart, no delete in a bucket another
// relay held.
func TestChaosPostgresRestart(t *testing.T) {
	if os.Getenv(EnvPGRestart) != "1" && !dbtest.InCI() {
		t.Skipf("restarts a PostgreSQL server of its own; set %s=1 (CI runs it)", EnvPGRestart)
	}
	runShortModes(t, "PostgreSQL restarts", func(p *params) {
		p.pgRestart = true
		// Every restart stalls the writers for a second or more: fewer
		// messages keep the run short.
		if os.Getenv(EnvMessages) == "" && !p.soak {
			p.messages = 10_000
			p.rate = float64(p.messages) / p.minChaos.Seconds()
		}
		p.faultEvery = 5 * time.Second
	})
}

// pgCluster is a PostgreSQL server of the test's own.
type pgCluster struct {
	bin  string // the server's bin directory
	dir  string // data directory; its parent holds the socket and the log
	log  string // the server's log
	port int

	mu       sync.Mutex
	restarts int
}

// pgBinDir finds the newest installed PostgreSQL server's bin directory.
func pgBinDir() (string, error) {
	if p, err := exec.LookPath("pg_config"); err == nil {
		if out, err := exec.Command(p, "--bindir").Output(); err == nil {
			dir := strings.TrimSpace(string(out))
			if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
				return dir, nil
			}
		}
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(matches) == 0 {
		return "", fmt.Errorf("no PostgreSQL server binaries (initdb) found: install Debian's postgresql package (scripts/services.sh does)")
	}
	sort.Slice(matches, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(matches[i]))))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(matches[j]))))
		return vi < vj
	})
	return filepath.Dir(matches[len(matches)-1]), nil
}

// startPGCluster initialises and starts a server on a free loopback port,
// stopped and removed when the test ends. conf lines are appended to its
// postgresql.conf (wal_level = logical for WAL mode).
func startPGCluster(t *testing.T, conf ...string) *pgCluster {
	t.Helper()
	fail := t.Skip
	if dbtest.InCI() {
		fail = t.Fatal
	}
	if os.Geteuid() != 0 {
		fail("the PostgreSQL restart test runs its server as the postgres user: it needs root")
	}
	bin, err := pgBinDir()
	if err != nil {
		fail(err)
	}
	pgUser, err := user.Lookup("postgres")
	if err != nil {
		fail("no postgres user: ", err)
	}
	uid, _ := strconv.Atoi(pgUser.Uid)
	gid, _ := strconv.Atoi(pgUser.Gid)
	root, err := os.MkdirTemp("", "oxchaos-pg-")
	require.NoError(t, err)
	require.NoError(t, os.Chown(root, uid, gid))
	c := &pgCluster{bin: bin, dir: filepath.Join(root, "data"), log: filepath.Join(root, "server.log")}
	t.Cleanup(func() {
		_, _ = c.ctl("stop", "-m", "immediate")
		_ = os.RemoveAll(root)
	})
	if out, err := c.asPostgres(filepath.Join(bin, "initdb"), "-D", c.dir, "-A", "trust", "-U", "postgres", "--no-sync"); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	c.port = ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	settings := fmt.Sprintf("\nlisten_addresses = '127.0.0.1'\nport = %d\nunix_socket_directories = '%s'\nmax_connections = 200\n"+
		// A crash of the server process, not of the machine: what a
		// restart tests does not depend on fsync, which costs the loaded
		// machine dearly.
		"fsync = off\nshared_buffers = 32MB\n", c.port, root) + strings.Join(conf, "\n") + "\n"
	f, err := os.OpenFile(filepath.Join(c.dir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteString(settings)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	if out, err := c.ctl("start", "-l", c.log); err != nil {
		t.Fatalf("pg_ctl start: %v\n%s\n%s", err, out, tail(c.log, 20))
	}
	return c
}

func (c *pgCluster) asPostgres(args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--"}, args...)...)
	cmd.Dir = "/"
	return cmd.CombinedOutput()
}

// ctl runs pg_ctl on the cluster, waiting for it to finish.
func (c *pgCluster) ctl(args ...string) ([]byte, error) {
	return c.asPostgres(append([]string{filepath.Join(c.bin, "pg_ctl"), "-D", c.dir, "-w", "-t", "120"}, args...)...)
}

// dsn is the DSN of database test on the cluster.
func (c *pgCluster) dsn() string {
	return fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=postgres sslmode=disable", c.port)
}

// open returns a fresh schema on the cluster, as dbtest.Open does on the
// shared server.
func (c *pgCluster) open(t *testing.T) *dbtest.DB {
	t.Helper()
	name := dbtest.Name("t_")
	admin, err := dbtest.OpenGorm(dbtest.Postgres, c.dsn(), &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	require.NoError(t, admin.Exec("CREATE SCHEMA "+name).Error)
	if sqlDB, err := admin.DB(); err == nil {
		_ = sqlDB.Close()
	}
	d := &dbtest.DB{Dialect: dbtest.Postgres, DSN: c.dsn() + " search_path=" + name, Namespace: name}
	d.DB, err = dbtest.OpenGorm(dbtest.Postgres, d.DSN, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := d.DB.DB()
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlDB.Close() })
	return d
}

// restart restarts the server with a fast (every session ends, a
// checkpoint) or an immediate (processes killed, recovery from the WAL at
// the next start) shutdown.
func (c *pgCluster) restart(mode string) error {
	// With its log file: without one the server writes to pg_ctl's
	// output, which this process would wait on for good.
	out, err := c.ctl("restart", "-m", mode, "-l", c.log)
	if err != nil {
		return fmt.Errorf("pg_ctl restart -m %s: %v: %s", mode, err, out)
	}
	c.mu.Lock()
	c.restarts++
	c.mu.Unlock()
	return nil
}

// stop stops the server with a fast or an immediate shutdown.
func (c *pgCluster) stop(mode string) error {
	if out, err := c.ctl("stop", "-m", mode); err != nil {
		return fmt.Errorf("pg_ctl stop -m %s: %v: %s", mode, err, out)
	}
	return nil
}

// start starts the stopped server and returns once it accepts
// connections (pg_ctl start -w).
func (c *pgCluster) start() error {
	if out, err := c.ctl("start", "-l", c.log); err != nil {
		return fmt.Errorf("pg_ctl start: %v: %s", err, out)
	}
	return nil
}

// PostgreSQL restart fault kinds.
const (
	evPGRestartFast      = "postgres_restart_fast"
	evPGRestartImmediate = "postgres_restart_immediate"
)

// pgRestarter restarts the cluster from the injector, one restart at a
// time, on a goroutine of its own (pg_ctl waits until the server is up).
type pgRestarter struct {
	c    *pgCluster
	done chan struct{} // the restart in progress, nil when none
}

func (r *pgRestarter) actions(in *injector) []action {
	return []action{
		{1, func() bool { return r.restart(in, "fast", evPGRestartFast) }},
		{1, func() bool { return r.restart(in, "immediate", evPGRestartImmediate) }},
	}
}

func (r *pgRestarter) restart(in *injector, mode, kind string) bool {
	if r.done != nil {
		return false
	}
	done := make(chan struct{})
	r.done = done
	var err error
	start := time.Now()
	go func() {
		defer close(done)
		err = r.c.restart(mode)
	}()
	in.log.add(event{Kind: kind, Slot: -1, Start: start, Note: mode})
	var wait func()
	wait = func() {
		select {
		case <-done:
			r.done = nil
			in.log.end(kind, -1, time.Now())
			if err != nil {
				in.t.Errorf("chaos: %v", err)
			}
		default:
			in.after(50*time.Millisecond, wait)
		}
	}
	in.after(50*time.Millisecond, wait)
	return true
}
