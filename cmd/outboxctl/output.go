package main

import (
	"encoding/base64"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/ops"
)

func newTable(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
}

// age formats a duration for people: 0s, 1.2s, 3m4s, 5h6m, 7d8h.
func age(d time.Duration) string {
	switch {
	case d <= 0:
		return "-"
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 48*time.Hour:
		return strings.TrimSuffix(d.Round(time.Minute).String(), "0s")
	}
	days := int(d / (24 * time.Hour))
	return fmt.Sprintf("%dd%dh", days, int((d-time.Duration(days)*24*time.Hour)/time.Hour))
}

func printStatus(w io.Writer, st ops.Status, cfg outbox.Config) {
	fmt.Fprintf(w, "outbox %s: %d buckets, %d pending", outboxLabel(cfg), st.BucketCount, st.Pending)
	if st.Pending > 0 {
		fmt.Fprintf(w, ", oldest %s old", age(st.OldestAge()))
	}
	fmt.Fprintf(w, ", dead letters %d failed + %d parked, %d live relay(s)\n\n", st.DeadLetters.Failed, st.DeadLetters.Parked, st.LiveRelays)

	tw := newTable(w)
	fmt.Fprintln(tw, "BUCKET\tPENDING\tOLDEST\tFAILED\tPARKED\tOWNER\tTERM\tEXPIRES IN\tPAUSED")
	for _, b := range st.Buckets {
		owner, expires, paused := leaseCells(b.Lease, st.SampledAt)
		fmt.Fprintf(tw, "%d\t%d\t%s\t%d\t%d\t%s\t%d\t%s\t%s\n", b.Bucket, b.Pending, age(time.Duration(b.OldestAgeMs)*time.Millisecond),
			b.DeadLetters.Failed, b.DeadLetters.Parked, owner, b.Lease.Term, expires, paused)
	}
	tw.Flush()
	printLeaseCount(w, st, cfg)
	printRetrying(w, st)

	fmt.Fprintln(w)
	if len(st.Relays) == 0 {
		fmt.Fprintln(w, "no relay heartbeats")
		return
	}
	tw = newTable(w)
	fmt.Fprintln(tw, "RELAY\tLIVE\tBUCKETS\tLAST SEEN\tUP")
	for _, r := range st.Relays {
		live := "no"
		if r.Live {
			live = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s ago\t%s\n", r.ID, live, r.Buckets, age(st.SampledAt.Sub(r.LastSeen)), age(r.LastSeen.Sub(r.StartedAt)))
	}
	tw.Flush()
}

// printRetrying prints, for each bucket held back by a message whose
// publish failed and is retried, that message and its last error: why
// the bucket does not advance, before the message becomes a dead letter.
func printRetrying(w io.Writer, st ops.Status) {
	for _, b := range st.Buckets {
		r := b.Retrying
		if r == nil {
			continue
		}
		fmt.Fprintf(w, "\nbucket %d retries message %d (topic %s, key %s, written %s ago) after %d failed attempt(s); last error: %s\n",
			b.Bucket, r.ID, r.Topic, printable(r.Key, 40), age(st.SampledAt.Sub(r.CreatedAt)), r.Attempts, clip(r.LastError, 300))
	}
}

// leaseCells are the OWNER, EXPIRES IN and PAUSED cells of a lease row.
func leaseCells(l ops.LeaseInfo, at time.Time) (owner, expires, paused string) {
	owner, expires, paused = "-", "-", "no"
	if l.Owner != "" {
		owner, expires = l.Owner, "expired"
		if l.Held {
			expires = age(l.ExpiresAt.Sub(at))
		}
	}
	if l.Paused {
		paused = "PAUSED"
	}
	return owner, expires, paused
}

// outboxLabel names the outbox as its metrics and logs do (Config.Name,
// --name), with its messages table when the two differ.
func outboxLabel(cfg outbox.Config) string {
	table := cfg.Tables.MessagesTable()
	if cfg.Name == "" || cfg.Name == table {
		return table
	}
	return cfg.Name + " (table " + table + ")"
}

// printLeaseCount prints the lease rows beyond --buckets, and says so
// when the lease table defines another count than --buckets.
func printLeaseCount(w io.Writer, st ops.Status, cfg outbox.Config) {
	if st.LeaseBuckets == 0 || st.LeaseBuckets == st.BucketCount {
		return
	}
	fmt.Fprintf(w, "\nWARNING: table %s defines %d buckets (rows up to bucket %d), not --buckets %d: the relays' BucketCount is %d; read the status with --buckets %d\n",
		cfg.Tables.LeasesTable(), st.LeaseBuckets, st.LeaseBuckets-1, st.BucketCount, st.LeaseBuckets, st.LeaseBuckets)
	if len(st.LeasesBeyond) == 0 {
		return
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "BUCKET\tOWNER\tTERM\tEXPIRES IN\tPAUSED")
	for _, l := range st.LeasesBeyond {
		owner, expires, paused := leaseCells(l, st.SampledAt)
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\n", l.Bucket, owner, l.Term, expires, paused)
	}
	tw.Flush()
}

// printWALStatus prints the status of an outbox in WAL mode: its name,
// the dead letters and the slot. The table-mode view (buckets, bucket
// leases, relay heartbeats) does not apply: one reader holds the slot's
// lease. Rows in the messages table are printed only when there are any
// (table-mode writers, relayed by a bridging reader).
func printWALStatus(w io.Writer, st ops.Status, cfg outbox.Config) {
	fmt.Fprintf(w, "outbox %s (WAL mode): dead letters %d failed + %d parked", cfg.Name, st.DeadLetters.Failed, st.DeadLetters.Parked)
	if st.Pending > 0 {
		fmt.Fprintf(w, ", %d row(s) in the messages table %s (table-mode writes; a bridging reader relays them), oldest %s old",
			st.Pending, cfg.Tables.MessagesTable(), age(st.OldestAge()))
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w)
	printWAL(w, *st.WAL, nil)
}

// printable returns b as text when it is printable UTF-8, else as
// base64:... Keyless is "(none)", the empty key "(empty)".
func printable(b []byte, max int) string {
	switch {
	case b == nil:
		return "(none)"
	case len(b) == 0:
		return "(empty)"
	}
	s := string(b)
	ok := utf8.ValidString(s)
	for _, r := range s {
		if !ok || (!unicode.IsPrint(r) && r != ' ') {
			ok = false
			break
		}
	}
	if !ok {
		s = "base64:" + base64.StdEncoding.EncodeToString(b)
	}
	return clip(s, max)
}

func clip(s string, max int) string {
	if max <= 0 || utf8.RuneCountInString(s) <= max {
		return s
	}
	r := []rune(s)
	return string(r[:max-1]) + "…"
}

// errorWrappers are the prefixes the publishers and the relay put before
// a message's failure: the failed message's position and id
// (publisher.Error), the permanent mark (relay.PermanentError) and the
// too-large class (publisher.ErrTooLarge). They say nothing an operator
// reading a dead letter does not already see in its row.
var errorWrappers = regexp.MustCompile(`^(?:publisher: message \d+ \(id "(?:[^"\\]|\\.)*", topic "(?:[^"\\]|\\.)*"\): |permanent: |publisher: message too large: )`)

// failureCause returns the innermost cause of a recorded failure: the
// stored text without the wrappers the outbox put around the sink's error.
func failureCause(lastError string) string {
	s := oneLine(lastError)
	for {
		loc := errorWrappers.FindStringIndex(s)
		if loc == nil || loc[1] == len(s) {
			return s
		}
		s = s[loc[1]:]
	}
}

func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// errorSummary is the part of a recorded failure the dead-letter list
// shows, whole: ops.ErrorCause, the cause and where, without the
// sink's raw text and the delivery note, which "dead-letters show" prints.
// A text recorded without a cause first (by an older release) is shown as
// its innermost cause.
func errorSummary(lastError string) string {
	return failureCause(ops.ErrorCause(lastError))
}

// deadLetterError is the ERROR cell of a dead letter: its cause, or for a
// parked one that did not fail, what it waits for.
func deadLetterError(d ops.DeadLetter) string {
	if d.State == ops.DeadLetterParked && d.LastError == "" {
		return "(parked: waits behind a failed message of its key; requeue the key)"
	}
	return errorSummary(d.LastError)
}

func maybeDelivered(d ops.DeadLetter) string {
	if d.MaybeDelivered {
		return "maybe"
	}
	return "no"
}

func printDeadLetters(w io.Writer, page ops.DeadLetterPage) {
	if len(page.Items) == 0 {
		fmt.Fprintln(w, "no dead letters")
		return
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "ID\tDIED\tSTATE\tDELIVERED\tBUCKET\tTOPIC\tKEY\tATTEMPTS\tSIZE\tERROR")
	for _, d := range page.Items {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%d\t%d\t%s\n", d.ID, d.DeadAt.UTC().Format(time.RFC3339), d.State, maybeDelivered(d),
			d.Bucket, d.Topic, printable(d.Key, 32), d.Attempts, d.ValueSize, deadLetterError(d))
	}
	tw.Flush()
	fmt.Fprintln(w)
	if slices.ContainsFunc(page.Items, func(d ops.DeadLetter) bool { return d.MaybeDelivered }) {
		fmt.Fprintln(w, "DELIVERED maybe: an earlier copy may already have reached consumers.")
	}
	fmt.Fprintln(w, "Whole error, key and value: outboxctl dead-letters show ID")
	if page.Next != "" {
		fmt.Fprintf(w, "\nmore: --cursor %s\n", page.Next)
	}
}

func printDeadLetter(w io.Writer, d ops.DeadLetter) {
	tw := newTable(w)
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	row("id", strconv.FormatInt(d.ID, 10))
	row("message id", d.MessageID)
	row("state", string(d.State))
	if d.MaybeDelivered {
		row("delivered", "maybe: "+strings.TrimPrefix(d.DeliveryNote, "may have been delivered: "))
	} else {
		row("delivered", "no earlier copy known")
	}
	row("bucket", strconv.Itoa(d.Bucket))
	row("topic", d.Topic)
	row("key", printable(d.Key, 0))
	if d.Partition != nil {
		row("partition", strconv.Itoa(int(*d.Partition)))
	}
	row("created", d.CreatedAt.UTC().Format(time.RFC3339Nano))
	row("died", d.DeadAt.UTC().Format(time.RFC3339Nano))
	row("attempts", strconv.Itoa(d.Attempts))
	if d.LastError != "" {
		row("cause", errorSummary(d.LastError))
		row("last error", oneLine(d.LastError))
	}
	for _, h := range d.Headers {
		row("header "+h.Key, printable(h.Value, 0))
	}
	if d.Value == nil {
		row("value", "(tombstone)")
	} else {
		row("value", fmt.Sprintf("%d bytes", len(d.Value)))
	}
	tw.Flush()
	if len(d.Value) > 0 {
		fmt.Fprintln(w)
		fmt.Fprintln(w, printable(d.Value, 4096))
	}
}

func joinInts[T int | int64](xs []T) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = strconv.FormatInt(int64(x), 10)
	}
	return strings.Join(parts, ",")
}

func decodeBase64(s string) ([]byte, error) {
	if b, err := base64.StdEncoding.DecodeString(s); err == nil {
		return b, nil
	}
	return base64.URLEncoding.DecodeString(s)
}
