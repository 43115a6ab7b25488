package gormrelay

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"gorm.io/gorm"
)

// Stale statistics (PostgreSQL). An outbox table is empty most of the
// time, so autovacuum's ANALYZE often records it empty: no rows over the
// pages that the last backlog left behind. When a backlog builds again (a
// Kafka outage, a burst), the planner still takes the table for empty. It
// estimates one row per bucket and reads a batch with a bitmap scan of
// the bucket's whole backlog and a sort, instead of walking the
// (bucket, id) index for the first BatchSize rows: every batch then costs
// time in proportion to the backlog (312 ms instead of about 1 ms for 500
// rows of a 62,500-row bucket; BENCHMARKS.md, "An outbox analyzed
// empty"), and the drainers keep the database's CPU busy, until autovacuum
// analyzes the table again, a minute later (autovacuum_naptime) or more.
//
// So when a read returns a full batch, at most every estimateCheckEvery
// (an EXPLAIN: a fraction of a millisecond), the store asks the planner
// how many rows it expects in that bucket. An estimate below the batch
// just read is stale, and the store analyzes the messages table, at most
// every analyzeEvery. ANALYZE reads a sample (30,000 rows by default),
// does not block writes, and waits at most analyzeLockTimeout for its
// lock (autovacuum may hold it).

const (
	// estimateCheckEvery spaces the checks of the planner's estimate.
	estimateCheckEvery = time.Second
	// analyzeEvery spaces the store's ANALYZEs.
	analyzeEvery = time.Minute
	// analyzeLockTimeout bounds the wait of the store's ANALYZE for its
	// table lock.
	analyzeLockTimeout = "2s"
	// analyzeWarnEvery spaces the warnings that an ANALYZE failed or did
	// not mend the estimate.
	analyzeWarnEvery = time.Hour
)

// estimateWatch is the state of the estimate checks.
type estimateWatch struct {
	mu sync.Mutex // held by the check in progress
	// nextCheck, nextAnalyze and nextWarn: no check, ANALYZE or warning
	// before.
	nextCheck, nextAnalyze, nextWarn time.Time
	// checks and analyses count the checks and the store's ANALYZEs,
	// for tests.
	checks, analyses int
	// now is the clock of the intervals; nil: time.Now (tests set it).
	now func() time.Time
}

// checkEstimate is called after a read of bucket returned a full batch of
// read rows. On PostgreSQL, at most every estimateCheckEvery and by one
// caller at a time (the others go on), it compares the planner's row
// estimate for the bucket with read and analyzes the messages table if
// the estimate is lower (at most every analyzeEvery). It runs on the
// drainer that read the batch, before its publish. It returns nothing: a
// failed ANALYZE is logged, and the reads go on as they were.
func (s *Store) checkEstimate(ctx context.Context, bucket, read int) {
	if !s.postgres {
		return
	}
	w := &s.estimate
	if !w.mu.TryLock() {
		return
	}
	defer w.mu.Unlock()
	now := time.Now()
	if w.now != nil {
		now = w.now()
	}
	if !due(&w.nextCheck, now, estimateCheckEvery) {
		return
	}
	w.checks++
	before, err := s.bucketEstimate(ctx, bucket)
	if err != nil || before >= float64(read) {
		return // a failed EXPLAIN: the reads report what fails in the database
	}
	if !due(&w.nextAnalyze, now, analyzeEvery) {
		return
	}
	start := time.Now()
	err = s.analyze(ctx)
	took := time.Since(start)
	w.analyses++
	after, aerr := s.bucketEstimate(ctx, bucket)
	if err == nil && aerr == nil && after >= float64(read) {
		s.logger.Info("outbox: the planner took the messages table for near empty while a backlog was drained; the relay analyzed it",
			"table", s.tables.MessagesTable(), "bucket", bucket, "estimated_rows", before, "estimated_after", after,
			"batch_read", read, "took_ms", took.Milliseconds())
		return
	}
	if !due(&w.nextWarn, now, analyzeWarnEvery) {
		return
	}
	if err == nil {
		err = aerr
	}
	s.logger.Warn("outbox: the planner takes the messages table for near empty while a backlog is drained, and the relay's ANALYZE did not mend it; "+
		"each batch read then scans its bucket's whole backlog. Let the relay's database user own the table, or analyze it (docs/operations.md, \"Statistics of the outbox table\")",
		"table", s.tables.MessagesTable(), "bucket", bucket, "estimated_rows", before, "estimated_after", after,
		"batch_read", read, "err", err)
}

// bucketEstimate returns the planner's estimate of the rows in bucket.
func (s *Store) bucketEstimate(ctx context.Context, bucket int) (float64, error) {
	db, ctx, cancel := s.op(ctx, "estimate bucket rows")
	defer cancel()
	var plan string
	// The bucket is an int: formatted into the statement, so that the
	// planner estimates for this bucket, as for the custom plans of reads.
	q := fmt.Sprintf("EXPLAIN (FORMAT JSON) SELECT 1 FROM %s WHERE bucket >= %d AND bucket <= %d", s.messages, bucket, bucket)
	if err := db.Raw(q).Row().Scan(&plan); err != nil {
		return 0, s.fail(ctx, "estimate bucket rows", err)
	}
	var out []struct {
		Plan struct {
			Rows float64 `json:"Plan Rows"`
		}
	}
	if err := json.Unmarshal([]byte(plan), &out); err != nil || len(out) == 0 {
		return 0, fmt.Errorf("outbox: store estimate bucket rows: unexpected plan %q: %v", plan, err)
	}
	return out[0].Plan.Rows, nil
}

// analyze runs ANALYZE on the messages table, waiting at most
// analyzeLockTimeout for its lock.
func (s *Store) analyze(ctx context.Context) error {
	db, ctx, cancel := s.op(ctx, "analyze messages")
	defer cancel()
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Exec("SET LOCAL lock_timeout = '" + analyzeLockTimeout + "'").Error; err != nil {
			return err
		}
		return tx.Exec("ANALYZE " + s.messages).Error
	})
	if err != nil {
		return s.fail(ctx, "analyze messages", err)
	}
	return nil
}
