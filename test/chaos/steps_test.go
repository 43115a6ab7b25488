package chaos_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	outbox "github.com/gorm-outbox/outbox"
)

// The steps runChaos and runChaosWAL share: faults for the chaos window,
// the crash of the server with a backlog, and the reckoning of what was
// committed against what was delivered.

// startFaults runs the injector until the returned stop is called (or the
// test ends); stop waits for the fault in progress to heal and may be
// called more than once.
func startFaults(t *testing.T, in *injector) (stop func()) {
	stopC, done := make(chan struct{}), make(chan struct{})
	var once sync.Once
	stop = func() { once.Do(func() { close(stopC) }); <-done }
	go func() {
		defer close(done)
		in.run(stopC)
	}()
	t.Cleanup(stop) // runs before the relays are killed
	return stop
}

// sleepUntil waits until the chaos window that began at start has lasted
// window, or ctx ends.
func sleepUntil(ctx context.Context, start time.Time, window time.Duration) {
	if rest := window - time.Since(start); rest > 0 {
		select {
		case <-time.After(rest):
		case <-ctx.Done():
		}
	}
}

// crashWithBacklog commits n messages in transactions of perTx and then
// crashes the server at once (immediate shutdown), so that the readers
// or relays cannot drain them first. It returns n.
func crashWithBacklog(t *testing.T, db *gorm.DB, sqlDB *sql.DB, idle int, plugin *outbox.Plugin, topic string, pgc *pgCluster, n, perTx int) int {
	t.Helper()
	// The pool's idle connections may have died with an earlier restart,
	// and die with this one.
	dropIdle := func() {
		sqlDB.SetMaxIdleConns(0)
		sqlDB.SetMaxIdleConns(idle)
	}
	dropIdle()
	written := writeBacklog(t, db, plugin, topic, n, perTx, nil)
	require.NoError(t, pgc.restart("immediate"))
	dropIdle()
	return written
}

// withMetadataRefresh adds to a resumption bound, on a real cluster, the
// producers' metadata refresh: after a broker restarted or resumed, a
// producer may hold requests for the old leaders (a strict-mode term's
// fencing included) until its next refresh (chaos-relay sets 5 s) before
// its retries find the new ones. It returns the bound and a note for the
// log.
func withMetadataRefresh(bound time.Duration, real *realBrokers) (time.Duration, string) {
	if real == nil {
		return bound, ""
	}
	return bound + chaosMetadataRefresh, fmt.Sprintf(" + the producers' metadata refresh %s", chaosMetadataRefresh)
}

// committed reads what the writers committed, the truth: each message id
// with its key and sequence number, and each key's number of messages.
func committed(t *testing.T, db *gorm.DB) (expected map[string]ref, perKey map[string]int32) {
	t.Helper()
	var rows []order
	require.NoError(t, db.Select("k", "seq", "msg_id").Find(&rows).Error)
	expected = make(map[string]ref, len(rows))
	perKey = map[string]int32{}
	for _, r := range rows {
		expected[r.MsgID] = ref{key: r.K, seq: r.Seq}
		perKey[r.K] = max(perKey[r.K], r.Seq+1)
	}
	return expected, perKey
}

// lostOf returns the committed messages never delivered.
func lostOf(expected map[string]ref, got consumed) []string {
	var lost []string
	for id := range expected {
		if got.seen[id] == 0 {
			lost = append(lost, id)
		}
	}
	return lost
}

// requireAllDelivered fails the test if a committed message was lost or a
// key misses a sequence number.
func requireAllDelivered(t *testing.T, lost []string, perKey map[string]int32, got consumed) {
	t.Helper()
	if len(lost) > 0 {
		slices.Sort(lost)
		require.Empty(t, lost[:min(len(lost), 20)], "%d messages lost", len(lost))
	}
	for k, n := range perKey {
		require.Equal(t, n, got.delivered[k], "key %s: every sequence number delivered", k)
	}
}
