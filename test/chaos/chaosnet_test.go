package chaos_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
)

// TestChaosNetwork runs the chaos suite with every relay in a network
// namespace of its own (netlab_test.go) and network faults only: a relay
// partitioned from the brokers or from the database, one direction of a
// link delayed, packets lost, and the heal. Besides what every chaos run
// asserts, order holds in both modes (the default publisher's order gate,
// strict mode's transactions), draining resumes within LeaseDuration plus
// three poll intervals after the last fault heals, and no relay deletes a
// row of a bucket whose lease another relay holds (the term guard, seen
// by a trigger on the messages table).
func TestChaosNetwork(t *testing.T) {
	runShortModes(t, "network faults", func(p *params) {
		p.network = true
		p.faultEvery = time.Second
	})
}

// runShortModes runs a focused chaos run in both modes, in parallel
// subtests: 20,000 messages (OUTBOX_CHAOS_MESSAGES, OUTBOX_SOAK apply)
// over a 30 s fault window on kfake, adjusted by set. On Apache Kafka
// (KAFKA_BROKERS) it skips: these runs bring their own kfake, so the pass
// on the real broker has nothing to add.
func runShortModes(t *testing.T, what string, set func(*params)) {
	eachMode(t, func(t *testing.T, strict bool) {
		if os.Getenv(kafkatest.EnvBrokers) != "" {
			t.Skip(what + " run on kfake only, in the kfake pass")
		}
		p := shortParams(t, strict)
		set(&p)
		runChaos(t, p)
	})
}

// eachMode runs fn in parallel subtests "default" and "strict".
func eachMode(t *testing.T, fn func(t *testing.T, strict bool)) {
	for _, strict := range []bool{false, true} {
		name := "default"
		if strict {
			name = "strict"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, strict)
		})
	}
}

// shortParams sizes a focused run: 20,000 messages (OUTBOX_CHAOS_MESSAGES,
// OUTBOX_SOAK apply) over a 30 s fault window.
func shortParams(t *testing.T, strict bool) params {
	p := loadParams(t, strict)
	if os.Getenv(EnvMessages) == "" && !p.soak {
		p.messages = 20_000
	}
	p.minChaos = 30 * time.Second
	if p.soak {
		p.minChaos = time.Duration(float64(p.messages)/p.rate*float64(time.Second)) + 10*time.Second
	}
	if os.Getenv(EnvRate) == "" && !p.soak {
		p.rate = float64(p.messages) / p.minChaos.Seconds()
	}
	return p
}

// Network fault kinds.
const (
	evNetPartitionBrokers = "net_partition_brokers"
	evNetPartitionDB      = "net_partition_database"
	evNetDelay            = "net_delay"
	evNetLoss             = "net_loss"
)

var netFaultKinds = []string{evNetPartitionBrokers, evNetPartitionDB, evNetDelay, evNetLoss}

// netInjector injects the network faults; the injector drives it.
type netInjector struct {
	lab    *netLab
	active map[int]string // slot -> the fault on one of its links
	// lapsed counts partitions from the database longer than the lease:
	// the relay could not renew, and its buckets went to its peers while
	// it was cut off. (Cut off from the brokers, a relay still renews.)
	lapsed int
	// cluster and topic, on Apache Kafka with a link per broker: the
	// faults on one broker's link (chaosnetkafka_test.go).
	cluster *netCluster
	topic   string
}

func (n *netInjector) actions(in *injector) []action {
	acts := []action{
		{2, func() bool { return n.partition(in, linkBroker) }},
		{3, func() bool { return n.partition(in, linkDB) }},
		{2, func() bool { return n.delay(in) }},
		{2, func() bool { return n.loss(in) }},
	}
	if n.lab.brokerLinks > 0 {
		acts = n.brokerFaultsFirst(in, append(acts,
			action{3, func() bool { return n.partitionOneBroker(in) }},
			action{2, func() bool { return n.slowBroker(in) }}))
	}
	return acts
}

// slot picks a relay slot with no fault on its links, leaving at least
// one relay unfaulted.
func (n *netInjector) slot(in *injector) int {
	if len(n.active) >= n.lab.slots-1 {
		return -1
	}
	var free []int
	for s := range n.lab.slots {
		if _, busy := n.active[s]; !busy {
			free = append(free, s)
		}
	}
	if len(free) == 0 {
		return -1
	}
	return free[in.rng.IntN(len(free))]
}

func (n *netInjector) start(in *injector, kind string, slot int, k linkKind, d time.Duration, note string, apply func() error) bool {
	if err := apply(); err != nil {
		in.t.Logf("chaos net: %s: %v", kind, err)
		_ = n.lab.heal(slot, k)
		return false
	}
	n.active[slot] = kind
	now := time.Now()
	in.log.add(event{Kind: kind, Slot: slot, Start: now, End: now.Add(d), Note: note + " for " + d.Round(time.Millisecond).String()})
	in.after(d, func() { n.heal(in, kind, slot, k) })
	return true
}

func (n *netInjector) heal(in *injector, kind string, slot int, k linkKind) {
	if n.active[slot] != kind {
		return
	}
	if err := n.lab.heal(slot, k); err != nil {
		in.t.Logf("chaos net: heal: %v", err)
		in.after(200*time.Millisecond, func() { n.heal(in, kind, slot, k) })
		return
	}
	delete(n.active, slot)
	in.log.end(kind, slot, time.Now())
}

// partition cuts a relay off the brokers or the database, both ways, for
// half a lease to three leases.
func (n *netInjector) partition(in *injector, k linkKind) bool {
	slot := n.slot(in)
	if slot < 0 {
		return false
	}
	d := in.jitter(in.lease/2, 3*in.lease)
	kind := evNetPartitionBrokers
	if k == linkDB {
		kind = evNetPartitionDB
	}
	ok := n.start(in, kind, slot, k, d, "both ways", func() error { return n.lab.partition(slot, k) })
	if ok && k == linkDB && d > in.lease {
		n.lapsed++
	}
	return ok
}

func side(in *injector) (byte, string) {
	if in.rng.IntN(2) == 0 {
		return 'h', "towards the relay"
	}
	return 'n', "from the relay"
}

// delay delays one direction of a link by 200 ms to 2 s for 2 to 6 s.
func (n *netInjector) delay(in *injector) bool {
	slot := n.slot(in)
	if slot < 0 {
		return false
	}
	k := linkKind(in.rng.IntN(2))
	sd, dir := side(in)
	d := in.jitter(200*time.Millisecond, 2*time.Second)
	rate := 32 << in.rng.IntN(4) // 32 to 256 kbit/s
	var how string
	return n.start(in, evNetDelay, slot, k, in.jitter(2*time.Second, 6*time.Second), "", func() error {
		var err error
		how, err = n.lab.delay(slot, k, sd, d, rate)
		return err
	}) && n.note(in, fmt.Sprintf("%s link, %s: %s", k, dir, how))
}

// loss drops 5 to 30% of the packets one way on a link for 2 to 6 s.
func (n *netInjector) loss(in *injector) bool {
	slot := n.slot(in)
	if slot < 0 {
		return false
	}
	k := linkKind(in.rng.IntN(2))
	sd, dir := side(in)
	pct, shift := 5+in.rng.IntN(26), 2+in.rng.IntN(3)
	var how string
	return n.start(in, evNetLoss, slot, k, in.jitter(2*time.Second, 6*time.Second), "", func() error {
		var err error
		how, err = n.lab.loss(slot, k, sd, pct, shift)
		return err
	}) && n.note(in, fmt.Sprintf("%s link, %s: %s", k, dir, how))
}

// note prefixes the last event's note.
func (n *netInjector) note(in *injector, s string) bool {
	in.log.mu.Lock()
	defer in.log.mu.Unlock()
	e := &in.log.events[len(in.log.events)-1]
	e.Note = s + e.Note
	return true
}

// healAll removes every fault on every link.
func (n *netInjector) healAll(in *injector) {
	for slot, kind := range n.active {
		for _, k := range []linkKind{linkBroker, linkDB} {
			if err := n.lab.heal(slot, k); err != nil {
				in.t.Logf("chaos net: heal: %v", err)
			}
		}
		delete(n.active, slot)
		in.log.end(kind, slot, time.Now())
	}
}

// ---------------------------------------------------------------------------
// The term guard, seen from the database

// deleteAudit records, for every DELETE on the messages table, the
// session that ran it (the relay slot, by application_name), when the
// statement began, and the lease of each bucket it deleted from as the
// statement's trigger reads it; and, for every lease, when each term
// began (a trigger on the leases table).
//
// The trigger reads the lease after the delete, with a snapshot of its
// own: a takeover that committed while the delete statement ran shows as
// the holder although the statement's guard, under the statement's
// snapshot, saw the relay's own term. Such a delete raced the takeover
// (the rows were the relay's when the statement began); a delete whose
// bucket's holder took it before the statement began is one the guard
// should have refused.
type deleteAudit struct {
	db    *gorm.DB
	table string
}

// installDeleteAudit adds a statement trigger on the messages table.
func installDeleteAudit(t *testing.T, db *gorm.DB, messages, leases string) *deleteAudit {
	t.Helper()
	q := db.Statement.Quote
	a := &deleteAudit{db: db, table: "chaos_deletes"}
	for _, stmt := range []string{
		`CREATE TABLE chaos_deletes (bucket int NOT NULL, n int NOT NULL, app text NOT NULL, owner text, term bigint, expires_at_ms bigint, at_ms bigint NOT NULL, stmt_ms bigint NOT NULL)`,
		`CREATE TABLE chaos_lease_terms (bucket int NOT NULL, term bigint NOT NULL, owner text, at_ms bigint NOT NULL)`,
		`CREATE FUNCTION chaos_note_terms() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' OR NEW.term IS DISTINCT FROM OLD.term OR NEW.owner IS DISTINCT FROM OLD.owner THEN
    INSERT INTO chaos_lease_terms (bucket, term, owner, at_ms)
    VALUES (NEW.bucket, NEW.term, NEW.owner, (extract(epoch FROM clock_timestamp()) * 1000)::bigint);
  END IF;
  RETURN NULL;
END $$`,
		`CREATE TRIGGER chaos_note_terms AFTER INSERT OR UPDATE ON ` + q(leases) + ` FOR EACH ROW EXECUTE FUNCTION chaos_note_terms()`,
		`CREATE FUNCTION chaos_note_deletes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO chaos_deletes (bucket, n, app, owner, term, expires_at_ms, at_ms, stmt_ms)
  SELECT g.bucket, g.n, current_setting('application_name'), l.owner, l.term, l.expires_at_ms,
         (extract(epoch FROM clock_timestamp()) * 1000)::bigint,
         (extract(epoch FROM statement_timestamp()) * 1000)::bigint
  FROM (SELECT bucket, COUNT(*)::int AS n FROM gone GROUP BY bucket) g
  LEFT JOIN ` + q(leases) + ` l ON l.bucket = g.bucket;
  RETURN NULL;
END $$`,
		`CREATE TRIGGER chaos_note_deletes AFTER DELETE ON ` + q(messages) + ` REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION chaos_note_deletes()`,
	} {
		require.NoError(t, db.Exec(stmt).Error, stmt)
	}
	return a
}

// The term's start is the last change of the bucket's term or owner to
// what the trigger read, before it read it (a lease released and taken
// again keeps its term).
//
// raceSlack is how long before a delete statement's start a takeover may
// have begun and still not be in the statement's snapshot: the takeover's
// commit follows its update by that much at most.
const raceSlack = 10 // ms

// foreignDeletes returns the deletes a relay slot made in a bucket whose
// lease, read by the trigger, another relay held (or had expired), unless
// that relay's term began after the statement did (less raceSlack): what
// the term guard must prevent. Those that raced a takeover are logged. A
// relay slot's id is chaos-<slot>-<gen> and its sessions'
// application_name <tag>-<slot>.
func (a *deleteAudit) foreignDeletes(t *testing.T, tag string) (total, byRelays int64, foreign []string) {
	var rows []struct {
		Bucket      int
		N           int64
		App         string
		Owner       *string
		Term        *int64
		ExpiresAtMs *int64
		AtMs        int64
		StmtMs      int64
		TermFromMs  *int64
	}
	require.NoError(t, a.db.Raw("SELECT d.bucket, d.n, d.app, d.owner, d.term, d.expires_at_ms, d.at_ms, d.stmt_ms,"+
		" (SELECT MAX(lt.at_ms) FROM chaos_lease_terms lt WHERE lt.bucket = d.bucket AND lt.term = d.term"+
		" AND lt.owner IS NOT DISTINCT FROM d.owner AND lt.at_ms <= d.at_ms) AS term_from_ms"+
		" FROM "+a.table+" d").Scan(&rows).Error)
	raced := 0
	for _, r := range rows {
		total += r.N
		slot, ok := strings.CutPrefix(r.App, tag+"-")
		if !ok {
			continue // not a relay's session
		}
		byRelays += r.N
		if _, err := strconv.Atoi(slot); err != nil {
			continue
		}
		if r.Owner == nil || !strings.HasPrefix(*r.Owner, "chaos-"+slot+"-") {
			owner := "<none>"
			if r.Owner != nil {
				owner = *r.Owner
			}
			what := fmt.Sprintf("slot %s deleted %d rows of bucket %d at %d (statement began at %d) while %s held it (term %v from %v, expires %v)",
				slot, r.N, r.Bucket, r.AtMs, r.StmtMs, owner, deref(r.Term), deref(r.TermFromMs), deref(r.ExpiresAtMs))
			if r.Owner != nil && r.TermFromMs != nil && *r.TermFromMs >= r.StmtMs-raceSlack {
				raced++
				t.Logf("chaos: a delete raced a takeover (the term began during the statement): %s", what)
				continue
			}
			foreign = append(foreign, what)
		}
	}
	if raced > 0 {
		t.Logf("chaos: %d deletes raced a takeover", raced)
	}
	return total, byRelays, foreign
}

func deref(p *int64) any {
	if p == nil {
		return nil
	}
	return *p
}

// lastFault runs the last fault of a run, fn, which returns once it
// healed, and logs it as an event.
func lastFault(t *testing.T, what string, events *eventLog, fn func()) {
	t.Helper()
	start := time.Now()
	fn()
	events.add(event{Kind: "last_fault", Slot: -1, Start: start, End: time.Now(), Note: what})
	t.Logf("chaos: last fault (%s) healed after %s", what, time.Since(start).Round(time.Millisecond))
}

// writeBacklog commits n messages in transactions of perTx over keys of
// their own (16 of them, or the given ones), calls after (if set) with
// the count written after each, and returns n.
func writeBacklog(t *testing.T, db *gorm.DB, plugin *outbox.Plugin, topic string, n, perTx int, after func(int), names ...string) int {
	t.Helper()
	if len(names) == 0 {
		for k := range 16 {
			names = append(names, fmt.Sprintf("backlog-%05d", k))
		}
	}
	keys := len(names)
	seq := make([]int32, keys)
	for done := 0; done < n; done += perTx {
		rows := make([]order, 0, perTx)
		msgs := make([]*outbox.Message, 0, perTx)
		for i := range min(perTx, n-done) {
			k := (done + i) % keys
			key := names[k]
			id := uuid.Must(uuid.NewV7()).String()
			rows = append(rows, order{K: key, Seq: seq[k], MsgID: id})
			msgs = append(msgs, &outbox.Message{ID: id, Topic: topic, Key: []byte(key), Value: []byte(key + "/" + strconv.Itoa(int(seq[k])))})
			seq[k]++
		}
		// A connection a database restart ended fails once; the same
		// rows are written again unless they committed.
		for attempt := 1; ; attempt++ {
			err := db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&rows).Error; err != nil {
					return err
				}
				return plugin.Enqueue(tx, msgs...)
			})
			if err == nil {
				break
			}
			committed, cerr := committedAnyway(context.Background(), db, rows[0].MsgID)
			require.NoError(t, cerr, "whether a backlog transaction committed")
			if committed {
				break
			}
			require.Less(t, attempt, 20, "write the backlog: %v", err)
		}
		if after != nil {
			after(done + len(rows))
		}
	}
	return n
}

// staleRelay is the network run's last fault, the term guard's case:
//
//  1. relays 1 and 2 are cut off from the brokers: they renew and take
//     leases, but publish nothing and so delete nothing;
//  2. messages are written to keys of relay 0's buckets, in a stream:
//     relay 0 publishes and deletes batch after batch and, halfway, is
//     cut off from the database: the statement it sends next, often a
//     delete, stays in its connection, unanswered;
//  3. once its peers hold all of relay 0's buckets, relay 0 is cut off
//     from the brokers and its database link heals: what it sent lands
//     now, under the new owners' leases, before they published the rows
//     (every relay's brokers stay cut off for two leases);
//  4. everything heals.
//
// The guard must refuse those deletes (the relay logs "lease lost before
// delete"); without it the delete-audit trigger records deletes by relay
// 0 in buckets another relay holds, and the test fails. It returns the
// messages written, and the messages pending and the time when the heal
// began.
func staleRelay(t *testing.T, lab *netLab, db *gorm.DB, plugin *outbox.Plugin, topic, leases, messages string, lease time.Duration, buckets int) (int, int64, time.Time) {
	t.Helper()
	for s := 1; s < lab.slots; s++ {
		require.NoError(t, lab.partition(s, linkBroker))
	}
	var own []int
	require.NoError(t, db.Raw("SELECT bucket FROM "+db.Statement.Quote(leases)+" WHERE owner LIKE 'chaos-0-%' AND expires_at_ms > ?",
		time.Now().UnixMilli()).Scan(&own).Error)
	var names []string
	for k := 0; len(names) < 16 && k < 100_000; k++ {
		name := fmt.Sprintf("stale-%05d", k)
		if slices.Contains(own, outbox.Bucket([]byte(name), nil, "", buckets)) {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		t.Logf("chaos: relay 0 holds no lease at the last fault; its keys are any")
	}
	n := writeBacklog(t, db, plugin, topic, 3000, 100, func(done int) {
		if done == 1500 {
			require.NoError(t, lab.partition(0, linkDB))
		}
	}, names...)
	// Relay 0's leases lapse and its peers take its buckets (once its
	// heartbeat lapsed too): until then relay 0, healed, could take them
	// back and drain them itself.
	q := "SELECT COUNT(*) FROM " + db.Statement.Quote(leases) + " WHERE bucket IN ? AND owner NOT LIKE 'chaos-0-%' AND expires_at_ms > ?"
	deadline := time.Now().Add(10 * lease)
	for len(own) > 0 {
		var taken int64
		require.NoError(t, db.Raw(q, own, time.Now().UnixMilli()).Scan(&taken).Error)
		if int(taken) == len(own) {
			break
		}
		require.True(t, time.Now().Before(deadline), "relay 0's peers hold %d of its %d buckets %s after it was cut off from the database", taken, len(own), 10*lease)
		time.Sleep(50 * time.Millisecond)
	}
	// Relay 0's brokers are cut before its database link heals: healed,
	// it would be a healthy relay that takes its fair share back and
	// drains the backlog before the heal, and the resumption would not
	// be measured. What it sent before the cut lands all the same.
	require.NoError(t, lab.partition(0, linkBroker))
	require.NoError(t, lab.heal(0, linkDB))
	// The fault's length: relay 0's connections retransmit what they hold
	// while the new owners cannot publish.
	time.Sleep(2 * lease)
	var pending int64
	require.NoError(t, db.Raw("SELECT COUNT(*) FROM "+db.Statement.Quote(messages)).Scan(&pending).Error)
	healStart := time.Now()
	for s := range lab.slots {
		require.NoError(t, lab.heal(s, linkBroker))
		require.NoError(t, lab.heal(s, linkDB))
	}
	return n, pending, healStart
}
