package pgwal

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric names of Reader.Collector. Every series carries the labels
// outbox (the outbox name) and slot.
const (
	NameRetainedBytes = "outbox_wal_retained_bytes"
	NameSlotLost      = "outbox_wal_slot_lost"
	NameConfirmedLSN  = "outbox_wal_confirmed_lsn"
	NameReceived      = "outbox_wal_received_total"
	NamePublished     = "outbox_wal_published_total"
	NameDeadLettered  = "outbox_wal_dead_lettered_total"
	// NameReading is 1 while this reader holds the slot's lease and reads
	// it, 0 while it waits or retries: the sum over every reader is 0 when
	// no reader reads the slot.
	NameReading = "outbox_wal_reading"
)

// scrapeTimeout bounds the slot query of one scrape.
const scrapeTimeout = 5 * time.Second

type collector struct {
	r                                                    *Reader
	retained, lost, confirmed, received, published, dead *prometheus.Desc
	reading                                              *prometheus.Desc
}

// Collector returns a Prometheus collector of the reader: its counters,
// its last confirmed position, and, read from pg_replication_slots at
// each scrape, the WAL the slot retains (alert on it: a reader that
// stopped makes the server keep WAL until max_slot_wal_keep_size
// invalidates the slot or the disk fills) and whether the slot is lost
// (1 when it is missing or its wal_status is "lost").
func (r *Reader) Collector() prometheus.Collector {
	cl := prometheus.Labels{"outbox": r.ocfg.Name, "slot": r.cfg.Slot}
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, cl) }
	return &collector{r: r,
		retained:  d(NameRetainedBytes, "WAL bytes the slot retains: pg_current_wal_lsn() - confirmed_flush_lsn."),
		lost:      d(NameSlotLost, "1 when the slot is missing, invalidated (wal_status lost) or another database's, else 0."),
		confirmed: d(NameConfirmedLSN, "The last position this reader confirmed to the server."),
		received:  d(NameReceived, "Outbox messages decoded from the slot, replays included."),
		published: d(NamePublished, "Messages the publisher acknowledged."),
		dead:      d(NameDeadLettered, "Messages written to the dead-letter table, failed and parked."),
		reading:   d(NameReading, "1 while this reader holds the slot's lease and reads it, else 0."),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.retained, c.lost, c.confirmed, c.received, c.published, c.dead, c.reading} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.r.Stats()
	ch <- prometheus.MustNewConstMetric(c.confirmed, prometheus.GaugeValue, float64(s.Confirmed))
	ch <- prometheus.MustNewConstMetric(c.received, prometheus.CounterValue, float64(s.Received))
	ch <- prometheus.MustNewConstMetric(c.published, prometheus.CounterValue, float64(s.Published))
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.CounterValue, float64(s.DeadLettered))
	reading := 0.0
	if c.r.cur.Load() != nil {
		reading = 1
	}
	ch <- prometheus.MustNewConstMetric(c.reading, prometheus.GaugeValue, reading)
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
	defer cancel()
	st, err := c.r.SlotStatus(ctx)
	if err != nil {
		return // the slot's series absent as unknown, as Admin.Collector's
	}
	lost, foreign := 0.0, st.foreign(c.r.cfg.Slot) != nil
	if !st.Exists || st.WALStatus == "lost" || foreign {
		lost = 1
	}
	ch <- prometheus.MustNewConstMetric(c.lost, prometheus.GaugeValue, lost)
	if st.Exists && !foreign {
		ch <- prometheus.MustNewConstMetric(c.retained, prometheus.GaugeValue, float64(st.RetainedBytes))
	}
}

// Metric names of Admin.Collector, with the labels outbox and slot. The
// Admin's collector also exports NameRetainedBytes and NameSlotLost,
// unless it is a reader's (Reader.Admin), whose Collector exports them.
const (
	// NameLeaseHeld is 1 while a reader, in any process, holds the slot's
	// lease (an owner whose lease has not expired), else 0.
	NameLeaseHeld = "outbox_wal_lease_held"
	// NameLagAge is the age of the oldest message the reader holding the
	// lease decoded and has not published or dead-lettered (0 when it
	// holds none), as WALStatus.LagAgeMs: absent while unknown (no reader
	// holds the lease, or its term has not read the WAL written before it
	// began).
	NameLagAge = "outbox_wal_lag_age_seconds"
)

type adminCollector struct {
	a                                 *Admin
	slotGauges                        bool
	retained, lost, leaseHeld, lagAge *prometheus.Desc
}

// Collector returns a Prometheus collector that needs no running reader:
// at each scrape it reads the slot (pg_replication_slots) and its lease
// row, as WALStatus does, and exports the WAL the slot retains
// (NameRetainedBytes), whether it is lost (NameSlotLost), whether a
// reader holds its lease (NameLeaseHeld) and the lag in time
// (NameLagAge). Register it in the process that serves the admin API or
// the health checks, so that deploy/prometheus/wal-alerts.yml fires while
// every reader is down. An Admin made by Reader.Admin leaves the slot's
// two gauges to the reader's Collector (register both in that process).
// A failed read (the database down) leaves these series out of that
// scrape, absent as unknown, and the rest of the scrape stands: an error
// would fail the whole scrape of the process, the relay's and the HTTP
// server's series with it, when they matter most.
func (a *Admin) Collector() prometheus.Collector {
	cl := prometheus.Labels{"outbox": a.plugin.Config().Name, "slot": a.cfg.Slot}
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, cl) }
	return &adminCollector{a: a, slotGauges: a.reader == nil,
		retained:  d(NameRetainedBytes, "WAL bytes the slot retains: pg_current_wal_lsn() - confirmed_flush_lsn."),
		lost:      d(NameSlotLost, "1 when the slot is missing, invalidated (wal_status lost) or another database's, else 0."),
		leaseHeld: d(NameLeaseHeld, "1 while a reader holds the slot's lease, else 0."),
		lagAge:    d(NameLagAge, "Age of the oldest message the reader holding the slot's lease has not published; absent while unknown."),
	}
}

func (c *adminCollector) Describe(ch chan<- *prometheus.Desc) {
	if c.slotGauges {
		ch <- c.retained
		ch <- c.lost
	}
	ch <- c.leaseHeld
	ch <- c.lagAge
}

func (c *adminCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
	defer cancel()
	ws, err := c.a.WALStatus(ctx)
	if err != nil {
		return // absent as unknown; see Collector
	}
	gauge := func(d *prometheus.Desc, v float64) { ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v) }
	if c.slotGauges {
		lost := 0.0
		if !ws.Exists || ws.Lost || ws.Foreign != "" {
			lost = 1
		}
		gauge(c.lost, lost)
		if ws.Exists && ws.Foreign == "" {
			gauge(c.retained, float64(ws.RetainedBytes))
		}
	}
	held := 0.0
	if ws.Reader.Held {
		held = 1
	}
	gauge(c.leaseHeld, held)
	if ws.LagSource != "" {
		gauge(c.lagAge, ws.LagAge().Seconds())
	}
}
