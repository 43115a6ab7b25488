package publisher_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// service is what both Kafka publishers offer: a relay.Publisher with the
// lifecycle of the module's background services.
type service interface {
	relay.Publisher
	Start(context.Context) error
	Stop(context.Context) error
	Close() error
	Stopped() <-chan struct{}
	Err() error
}

// publishers builds each Kafka publisher, unstarted, on brokers; configure
// adjusts the sarama configuration after fastConfig.
func publishers(configure func(*sarama.Config)) map[string]func(t *testing.T, brokers []string) service {
	sc := func(c *sarama.Config) error {
		_ = fastConfig(c)
		if configure != nil {
			configure(c)
		}
		return nil
	}
	quiet := slog.New(slog.DiscardHandler)
	return map[string]func(*testing.T, []string) service{
		"kafka": func(t *testing.T, brokers []string) service {
			k, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: brokers, Configure: sc, Logger: quiet})
			require.NoError(t, err)
			return k
		},
		"transactional": func(t *testing.T, brokers []string) service {
			tx, err := publisher.NewTransactional(publisher.TransactionalConfig{
				Brokers: brokers, TransactionalIDPrefix: txnPrefix(t), Configure: sc, Logger: quiet,
			})
			require.NoError(t, err)
			return tx
		},
	}
}

// requireNotStarted fails t unless err is the error of a publisher used
// before Start: a misconfiguration that tells the fix.
func requireNotStarted(t testing.TB, err error) {
	t.Helper()
	require.ErrorIs(t, err, publisher.ErrNotStarted)
	require.True(t, relay.IsMisconfiguration(err), "%v", err)
	require.ErrorContains(t, err, "call Start before the relay publishes")
}

// Both Kafka publishers have the lifecycle of the module's services: the
// constructor connects nothing and Publish before Start says so; Stop
// before Start and a second Stop are harmless; Stop is synchronous
// (Publish fails with ErrClosed after it); Start on a running publisher
// is a no-op and after Stop an error; Stopped closes for a started
// publisher, and the end of the Start context stops it too.
func TestPublisherLifecycle(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	for name, open := range publishers(nil) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			msg := []relay.Message{{Topic: c.Topic(t, 1), Key: []byte("k"), Value: []byte("v"), MessageID: "m1", Bucket: 0}}

			unstarted := open(t, c.Brokers())
			_, err := unstarted.Publish(ctx, msg)
			requireNotStarted(t, err)
			_, err = unstarted.Publish(ctx, nil)
			requireNotStarted(t, err)
			if la, ok := unstarted.(relay.LeaseAware); ok {
				requireNotStarted(t, la.LeasesAcquired(ctx, []relay.Lease{{Bucket: 0, Term: 1}}))
				la.LeasesReleased(ctx, []relay.Lease{{Bucket: 0, Term: 1}})
			}

			never := unstarted
			require.NoError(t, never.Stop(ctx), "Stop before Start")
			require.NoError(t, never.Stop(ctx), "second Stop")
			_, err = never.Publish(ctx, msg)
			require.ErrorIs(t, err, publisher.ErrClosed)
			require.ErrorIs(t, never.Start(ctx), publisher.ErrStopped, "Start after Stop")
			select {
			case <-never.Stopped():
				t.Fatal("Stopped closed for a publisher that never started")
			default:
			}

			p := open(t, c.Brokers())
			require.NoError(t, p.Start(ctx))
			require.NoError(t, p.Start(ctx), "Start on a running publisher")
			acked, err := p.Publish(ctx, msg)
			require.NoError(t, err)
			require.Equal(t, 1, acked)
			require.NoError(t, p.Stop(ctx))
			<-p.Stopped()
			require.NoError(t, p.Err())
			require.NoError(t, p.Stop(ctx), "second Stop")
			require.NoError(t, p.Close(), "Close after Stop")
			_, err = p.Publish(ctx, msg)
			require.ErrorIs(t, err, publisher.ErrClosed)
			require.ErrorIs(t, p.Start(ctx), publisher.ErrStopped, "a publisher runs once")

			q := open(t, c.Brokers())
			startCtx, cancel := context.WithCancel(ctx)
			require.NoError(t, q.Start(startCtx))
			cancel()
			<-q.Stopped()
			require.NoError(t, q.Err())
			_, err = q.Publish(ctx, msg)
			require.ErrorIs(t, err, publisher.ErrClosed)
			require.ErrorIs(t, q.Start(ctx), publisher.ErrStopped)
			require.NoError(t, q.Close())

			closed := open(t, c.Brokers())
			require.NoError(t, closed.Close(), "Close before Start")
			require.ErrorIs(t, closed.Start(ctx), publisher.ErrStopped)
		})
	}
}

// CheckReady tells a relay, before it starts, what Publish would: before
// Start an error wrapping ErrNotStarted, nil once started, and after Stop a
// misconfiguration wrapping ErrClosed (a publisher runs once); a
// TracingPublisher forwards it.
func TestPublisherCheckReady(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	for name, open := range publishers(nil) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			p := open(t, c.Brokers())
			for _, rc := range []relay.ReadyChecker{p.(relay.ReadyChecker), publisher.TracingPublisher(p, nil).(relay.ReadyChecker)} {
				requireNotStarted(t, rc.CheckReady(ctx))
			}
			require.NoError(t, p.Start(ctx))
			require.NoError(t, p.(relay.ReadyChecker).CheckReady(ctx))
			require.NoError(t, publisher.TracingPublisher(p, nil).(relay.ReadyChecker).CheckReady(ctx))
			require.NoError(t, p.Stop(ctx))
			err := p.(relay.ReadyChecker).CheckReady(ctx)
			require.ErrorIs(t, err, publisher.ErrClosed)
			require.True(t, relay.IsMisconfiguration(err), "%v", err)
		})
	}
}

// The constructors open no connection: they succeed on an address nothing
// listens on. Start is what connects, and fails there with a clear error;
// the publisher stays unstarted (Publish says so), and Stop ends it.
func TestPublisherStartFailsWithoutBroker(t *testing.T) {
	t.Parallel()
	nobody := kafkatest.RefusingAddr(t)
	want := map[string]string{"kafka": "publisher: start Kafka producer", "transactional": "publisher: connect to Kafka"}
	for name, open := range publishers(func(c *sarama.Config) { c.Metadata.Retry.Max = 1 }) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			p := open(t, []string{nobody})
			err := p.Start(ctx)
			require.ErrorIs(t, err, sarama.ErrOutOfBrokers)
			require.ErrorContains(t, err, want[name])
			require.NoError(t, ctx.Err(), "the connect failed on its own, not by the test's deadline")
			_, err = p.Publish(ctx, []relay.Message{{Topic: "t", Value: []byte("v")}})
			requireNotStarted(t, err)
			require.ErrorIs(t, p.Start(ctx), sarama.ErrOutOfBrokers, "a failed Start can be tried again")
			require.NoError(t, p.Stop(ctx))
			require.ErrorIs(t, p.Start(ctx), publisher.ErrStopped)
		})
	}
}

// Start is bounded by its context although sarama's constructors are not:
// against a broker that accepts connections and never answers, Start
// returns the context's error as soon as it ends, and the publisher stays
// unstarted. The abandoned connect goes on in the background; once the
// broker answers it succeeds, and what it opened is closed: no goroutine
// of sarama or the publisher is left. A second Start then connects.
//
// Not parallel: it counts every goroutine running sarama or publisher
// code, which no other test of the package may start meanwhile (the
// parallel tests wait until the sequential ones are done).
func TestPublisherStartBoundedByContext(t *testing.T) {
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	// The broker never answering must be the only way the connect can
	// end: no read timeout ends it first.
	for name, open := range publishers(func(c *sarama.Config) { c.Net.ReadTimeout = time.Hour }) {
		t.Run(name, func(t *testing.T) {
			g := newGate(t, c.Brokers()[0])
			before := goroutineIDs()

			p := open(t, []string{g.addr()})
			require.Empty(t, clientGoroutines(before), "the constructor starts no goroutine")
			require.Zero(t, g.accepted(), "the constructor opens no connection")

			// End Start's context once the connect reached the broker.
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			go func() {
				select {
				case <-g.first:
					cancel()
				case <-ctx.Done():
				}
			}()
			err := p.Start(ctx)
			require.ErrorIs(t, err, context.Canceled)
			require.Positive(t, g.accepted())
			require.Zero(t, g.forwarded(), "the broker has not answered anything: the connect cannot have finished")
			_, err = p.Publish(t.Context(), []relay.Message{{Topic: topic, Value: []byte("v")}})
			requireNotStarted(t, err)

			g.open() // the broker answers from now on
			assert.EventuallyWithT(t, func(c *assert.CollectT) {
				assert.Positive(c, g.forwarded(), "the abandoned connect reached the broker again")
				assert.Empty(c, clientGoroutines(before), "what the abandoned connect opened is closed")
			}, 30*time.Second, 10*time.Millisecond)

			require.NoError(t, p.Start(t.Context()), "a Start that failed can be tried again")
			acked, err := p.Publish(t.Context(), []relay.Message{{Topic: topic, Key: []byte("k"), Value: []byte("v"), MessageID: name}})
			require.NoError(t, err)
			require.Equal(t, 1, acked)
			require.NoError(t, p.Stop(t.Context()))
			assert.EventuallyWithT(t, func(c *assert.CollectT) {
				assert.Empty(c, clientGoroutines(before), "Stop leaves nothing running")
			}, 30*time.Second, 10*time.Millisecond)
		})
	}
}

// Stop bounds a Start in progress: Stop while Start waits for a broker
// that never answers closes the publisher, Start then fails with
// ErrStopped once its connect ends, and nothing is left running.
func TestPublisherStopDuringStart(t *testing.T) {
	c := kafkatest.Start(t)
	for name, open := range publishers(func(c *sarama.Config) { c.Net.ReadTimeout = time.Hour }) {
		t.Run(name, func(t *testing.T) {
			g := newGate(t, c.Brokers()[0])
			before := goroutineIDs()
			p := open(t, []string{g.addr()})
			started := make(chan error, 1)
			go func() { started <- p.Start(t.Context()) }()
			<-g.first

			stopCtx, cancel := context.WithCancel(t.Context())
			cancel()
			require.ErrorIs(t, p.Stop(stopCtx), context.Canceled, "Stop is bounded by its context; the connect still runs")
			g.open()
			require.ErrorIs(t, <-started, publisher.ErrStopped)
			require.NoError(t, p.Stop(t.Context()))
			_, err := p.Publish(t.Context(), []relay.Message{{Topic: "t", Value: []byte("v")}})
			require.ErrorIs(t, err, publisher.ErrClosed)
			assert.EventuallyWithT(t, func(c *assert.CollectT) {
				assert.Empty(c, clientGoroutines(before))
			}, 30*time.Second, 10*time.Millisecond)
		})
	}
}

// gate is a TCP listener in front of a broker. Until open is called it
// accepts connections and never answers them; open closes those and
// forwards every later connection to the broker.
type gate struct {
	ln     net.Listener
	target string
	first  chan struct{} // closed at the first connection

	mu       sync.Mutex
	isOpen   bool
	closed   bool
	n, fwd   int
	conns    []net.Conn
	handlers sync.WaitGroup
}

func newGate(t *testing.T, target string) *gate {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	g := &gate{ln: ln, target: target, first: make(chan struct{})}
	g.handlers.Add(1)
	go g.serve()
	t.Cleanup(g.close)
	return g
}

func (g *gate) addr() string { return g.ln.Addr().String() }

func (g *gate) serve() {
	defer g.handlers.Done()
	for {
		conn, err := g.ln.Accept()
		if err != nil {
			return
		}
		g.mu.Lock()
		if g.n++; g.n == 1 {
			close(g.first)
		}
		forward := g.isOpen && !g.closed
		if forward {
			g.fwd++
			g.handlers.Add(1)
		}
		g.conns = append(g.conns, conn)
		g.mu.Unlock()
		if forward {
			go g.forward(conn)
		}
	}
}

func (g *gate) forward(conn net.Conn) {
	defer g.handlers.Done()
	defer conn.Close()
	up, err := net.Dial("tcp", g.target)
	if err != nil {
		return
	}
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		_ = up.Close()
		return
	}
	g.conns = append(g.conns, up)
	g.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, conn); done <- struct{}{} }()
	go func() { _, _ = io.Copy(conn, up); done <- struct{}{} }()
	<-done
	_ = up.Close()
	_ = conn.Close()
	<-done
}

func (g *gate) open() {
	g.mu.Lock()
	g.isOpen = true
	held := g.conns
	g.conns = nil
	g.mu.Unlock()
	for _, c := range held {
		_ = c.Close()
	}
}

func (g *gate) accepted() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
}

func (g *gate) forwarded() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.fwd
}

func (g *gate) close() {
	_ = g.ln.Close()
	g.mu.Lock()
	g.closed = true
	conns := g.conns
	g.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
	g.handlers.Wait()
}

// goroutineIDs returns the ids of the goroutines running now.
func goroutineIDs() map[string]bool {
	ids := map[string]bool{}
	for _, g := range goroutineStacks() {
		ids[goroutineID(g)] = true
	}
	return ids
}

// clientGoroutines returns the stacks of the goroutines running sarama or
// publisher code, except those in skip.
func clientGoroutines(skip map[string]bool) []string {
	var out []string
	for _, g := range goroutineStacks() {
		if skip[goroutineID(g)] {
			continue
		}
		if strings.Contains(g, "github.com/IBM/sarama.") || strings.Contains(g, "github.com/gorm-outbox/outbox/publisher.") {
			out = append(out, g)
		}
	}
	return out
}

func goroutineStacks() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Split(string(buf[:n]), "\n\n")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// goroutineID is the "goroutine N" that starts a stack.
func goroutineID(stack string) string {
	id, _, _ := strings.Cut(stack, " [")
	return id
}
