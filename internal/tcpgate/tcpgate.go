// Package tcpgate is a TCP forwarder for tests that cut a server off
// without touching it: while open it forwards each connection to the
// target; while shut it closes every new connection at once, as a server
// that is down or restarting does, and Shut closes the ones it forwards.
package tcpgate

import (
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// Gate forwards TCP connections from a loopback port to a target.
type Gate struct {
	ln      net.Listener
	target  string
	open    atomic.Bool
	refused atomic.Int64
	wg      sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]bool // the forwarded connections, both sides
}

// Start listens on a loopback port and forwards to target (host:port)
// while open; the gate starts shut. The test's cleanup closes it and
// waits for its goroutines.
func Start(t testing.TB, target string) *Gate {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	g := &Gate{ln: ln, target: target, conns: map[net.Conn]bool{}}
	g.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if !g.open.Load() {
				g.refused.Add(1)
				_ = c.Close()
				continue
			}
			g.wg.Go(func() { g.forward(c) })
		}
	})
	t.Cleanup(func() { _ = ln.Close(); g.Shut(); g.wg.Wait() })
	return g
}

func (g *Gate) forward(c net.Conn) {
	defer c.Close()
	s, err := net.Dial("tcp", g.target)
	if err != nil {
		return
	}
	defer s.Close()
	g.mu.Lock()
	if !g.open.Load() {
		g.mu.Unlock()
		return
	}
	g.conns[c], g.conns[s] = true, true
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		delete(g.conns, c)
		delete(g.conns, s)
		g.mu.Unlock()
	}()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(s, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, s); done <- struct{}{} }()
	<-done
}

// Open forwards the connections made from now on.
func (g *Gate) Open() { g.open.Store(true) }

// Shut closes the gate and every connection it forwards, as a server
// that stops does.
func (g *Gate) Shut() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.open.Store(false)
	for c := range g.conns {
		_ = c.Close()
	}
}

// Refused returns how many connections the gate closed at once because
// it was shut.
func (g *Gate) Refused() int64 { return g.refused.Load() }

// Port returns the gate's loopback port.
func (g *Gate) Port() int { return g.ln.Addr().(*net.TCPAddr).Port }

// Via returns the keyword/value pair that, appended to a PostgreSQL
// keyword/value DSN, connects through the gate.
func (g *Gate) Via() string { return " host=127.0.0.1 port=" + strconv.Itoa(g.Port()) }
