package pgwal

import (
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/relay"
)

// Defaults applied by Config.WithDefaults.
const (
	LeaseDurationDefault   = 10 * time.Second
	StandbyIntervalDefault = 2 * time.Second
	ConfirmIntervalDefault = 250 * time.Millisecond
	BatchSizeDefault       = 100
	MaxPendingDefault      = 10_000
	MaxAttemptsDefault     = 10
	BackoffMinDefault      = 100 * time.Millisecond
	BackoffMaxDefault      = 10 * time.Second
)

// ProbeIntervalMin is the least time between two of Run's probes of
// whether the database answers again during an outage: they run every
// max(BackoffMin, ProbeIntervalMin), as a table-mode relay's do
// (relay.ProbeIntervalMin, 100ms). Each probe opens a session and a
// replication connection, so a BackoffMin of a few milliseconds would
// otherwise try a server that is restarting hundreds of times a second;
// at this floor an outage's end is seen at most 100ms late, which is
// small next to the restart it follows. It equals BackoffMinDefault: the
// default configuration probes as often as before the floor.
const ProbeIntervalMin = relay.ProbeIntervalMin

// Config configures a Reader. ReplicationDSN is required; the zero value
// of every other field takes its default.
type Config struct {
	// ReplicationDSN is the connection string (keyword/value or URL) of
	// the PostgreSQL database the writers use; the reader adds
	// replication=database. Its role needs the REPLICATION attribute and
	// pg_hba.conf must allow replication connections.
	ReplicationDSN string
	// Slot is the logical replication slot, created at the first Run when
	// missing; it is also the name of the (empty) publication pgoutput
	// needs and the key of the reader's lease. Lowercase letters, digits
	// and underscores, at most 63 characters. Default "outbox_" followed
	// by the outbox name reduced to those characters.
	Slot string
	// LeaseTable holds the lease that elects the one reader of the slot.
	// Default: the outbox's leases table name followed by "_wal".
	LeaseTable string
	// RelayID identifies this reader in the lease. Default:
	// hostname-pid-random.
	RelayID string
	// LeaseDuration is how long the lease lasts without renewal: another
	// reader takes the slot over that long after this one died. Default
	// 10s.
	LeaseDuration time.Duration
	// StandbyInterval is how often the reader renews its lease, records
	// its confirmed position and sends a standby status update to the
	// server; the server's requests for a reply are answered at once.
	// Default 2s; less than LeaseDuration/2.
	StandbyInterval time.Duration
	// ConfirmInterval is how soon after the last renewal the reader
	// renews again, recording and confirming its position, when messages
	// were published since: a reader that dies publishes again only what
	// it published in this interval before, not a whole StandbyInterval.
	// Default 250ms (at most StandbyInterval).
	ConfirmInterval time.Duration
	// BatchSize is the most messages of one bucket handed to one Publish
	// call (the relay engine's relay.Config.BatchSize). Default 100.
	BatchSize int
	// Parallelism is how many buckets publish at once (the relay engine's
	// relay.Config.Parallelism): each bucket's messages are published in
	// order, one batch at a time. Default: the outbox's BucketCount, at
	// most relay.ParallelismMax (256).
	Parallelism int
	// MaxPending bounds the messages decoded but not yet published; the
	// reader stops reading the stream while it is reached. Default 10,000.
	MaxPending int
	// MaxAttempts is how many failed publishes with an error that is
	// neither permanent nor an outage (relay.IsUnavailable) a message gets
	// before it is dead-lettered, and the later messages of its key parked
	// behind it (the failure policy of table mode's
	// gormrelay.FailurePolicy). Permanent errors dead-letter at once;
	// outages are retried for as long as they last. Default 10.
	MaxAttempts int
	// BackoffMin and BackoffMax bound the pause after a failed publish
	// (the relay engine's relay.Config.BackoffMin and BackoffMax) or a
	// lost connection, doubling per consecutive failure. A pause after
	// the database could not be reached ends early, at most
	// max(BackoffMin, ProbeIntervalMin) after the database answers again:
	// Run probes it that often (never more often than every
	// ProbeIntervalMin, 100ms, however small BackoffMin is). Default
	// 100ms and 10s.
	BackoffMin, BackoffMax time.Duration
	// Bridge makes the reader relay the rows table-mode writers insert
	// into the messages table too, in commit order with the WAL
	// messages, and delete them once published: the slot's publication
	// includes the messages table (inserts only) from EnsureSlot or Run
	// on. It is what lets writers in table mode and in WAL mode run at
	// the same time on the same keys while a service switches modes; no
	// table-mode relay may run while a bridging reader publishes (see
	// docs/wal-mode.md, Switching modes). Default false.
	Bridge bool
	// FailoverSlot creates the slot as a failover slot (PostgreSQL 17+,
	// CREATE_REPLICATION_SLOT ... (FAILOVER true)) and turns the option
	// on for an existing slot, so that a standby with
	// sync_replication_slots = on keeps a synchronized copy that survives
	// a promotion (docs/wal-mode.md, Failover). On an older server
	// EnsureSlot and Run fail with a *relay.ConfigError. Default false.
	FailoverSlot bool
	// Observer receives the relay engine's instrumentation events
	// (publishes, dead letters, owned buckets) as in table mode;
	// *metrics.Collector implements it. Default: relay.NopObserver.
	Observer relay.Observer
	// Logger receives the reader's logs. Default slog.Default().
	Logger *slog.Logger
}

var slotRE = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// slotName reduces an outbox name to a slot name.
func slotName(name string) string {
	b := []byte("outbox_")
	for i := 0; i < len(name) && len(b) < 63; i++ {
		c := name[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '_':
			b = append(b, c)
		case c >= 'A' && c <= 'Z':
			b = append(b, c+'a'-'A')
		default:
			b = append(b, '_')
		}
	}
	return string(b)
}

// withDefaults fills in c for the outbox oc.
func (c Config) withDefaults(oc outbox.Config) Config {
	if c.Slot == "" {
		c.Slot = slotName(oc.Name)
	}
	if c.LeaseTable == "" {
		c.LeaseTable = oc.Tables.Leases + "_wal"
	}
	if c.RelayID == "" {
		host, _ := os.Hostname()
		c.RelayID = host + "-" + strconv.Itoa(os.Getpid()) + "-" + uuid.NewString()[:8]
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = LeaseDurationDefault
	}
	if c.StandbyInterval == 0 {
		c.StandbyInterval = min(StandbyIntervalDefault, c.LeaseDuration/3)
	}
	if c.ConfirmInterval == 0 {
		c.ConfirmInterval = min(ConfirmIntervalDefault, c.StandbyInterval)
	}
	if c.BatchSize == 0 {
		c.BatchSize = BatchSizeDefault
	}
	if c.Parallelism == 0 {
		c.Parallelism = min(max(oc.BucketCount, 1), relay.ParallelismMax)
	}
	if c.MaxPending == 0 {
		c.MaxPending = MaxPendingDefault
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = MaxAttemptsDefault
	}
	if c.BackoffMin == 0 {
		c.BackoffMin = BackoffMinDefault
	}
	if c.BackoffMax == 0 {
		c.BackoffMax = max(BackoffMaxDefault, c.BackoffMin)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Observer == nil {
		c.Observer = relay.NopObserver{}
	}
	return c
}

func (c Config) validate() error {
	bad := func(field string, value any, reason string) error {
		return &relay.ConfigError{Package: "pgwal", Field: field, Value: value, Reason: reason}
	}
	switch {
	case c.ReplicationDSN == "":
		return bad("ReplicationDSN", "", "required")
	case !slotRE.MatchString(c.Slot):
		return bad("Slot", fmt.Sprintf("%q", c.Slot), "must match [a-z0-9_]{1,63}")
	case c.LeaseDuration < 3*c.StandbyInterval || c.StandbyInterval <= 0:
		return bad("StandbyInterval", c.StandbyInterval, fmt.Sprintf("must be positive and at most a third of LeaseDuration (%s)", c.LeaseDuration))
	case c.ConfirmInterval <= 0 || c.ConfirmInterval > c.StandbyInterval:
		return bad("ConfirmInterval", c.ConfirmInterval, fmt.Sprintf("must be positive and at most StandbyInterval (%s)", c.StandbyInterval))
	case c.BatchSize < 1:
		return bad("BatchSize", c.BatchSize, "must be positive")
	case c.BatchSize > relay.BatchSizeMax:
		return bad("BatchSize", c.BatchSize, fmt.Sprintf("at most %d", relay.BatchSizeMax))
	case c.Parallelism < 1 || c.Parallelism > relay.ParallelismMax:
		return bad("Parallelism", c.Parallelism, fmt.Sprintf("must be between 1 and %d", relay.ParallelismMax))
	case c.MaxPending < c.BatchSize:
		return bad("MaxPending", c.MaxPending, "must be at least BatchSize")
	case c.MaxAttempts < 1:
		return bad("MaxAttempts", c.MaxAttempts, "must be positive")
	case c.BackoffMin < 0 || c.BackoffMax < c.BackoffMin:
		return bad("BackoffMax", c.BackoffMax, "must be at least BackoffMin, both not negative")
	case len(c.RelayID) > 128:
		return bad("RelayID", c.RelayID, "at most 128 characters")
	}
	return outbox.ValidateIdentifier("LeaseTable", c.LeaseTable)
}
