package publisher

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/IBM/sarama"

	"github.com/gorm-outbox/outbox/relay"
)

// The progress marker is how strict mode's Kafka transactions tell the
// database what they committed. Every transaction of bucket b also commits,
// atomically with its records (TxnOffsetCommit), an offset in the consumer
// group ProgressGroup(b): the offset is the bucket's sequence number, one
// more for every committed transaction, and its metadata records the row
// ids (relay.Message.ID) the transaction carried: their list, or their
// span when the list does not fit (encodeMarkerSums). The group has no
// members; it is only a place the broker stores a value transactionally.
// The offset is committed under the topic of the batch's first record,
// partition 0 (the broker only stores offsets of partitions that exist);
// the reader takes the entry with the highest sequence number of all the
// group's entries.
//
// A producer reads the marker when it starts, after InitProducerID fenced
// the bucket's previous owner (so that owner's last transaction is
// committed or aborted), with an OffsetFetch that requires stable offsets
// (a transactional commit still being written is waited for, not missed).
// Reconcile hands the ids and the digest of the batch's message ids
// (relay.MessagesDigest) to the relay, which deletes those rows from the
// store before it reads the bucket, if they hold those messages: they are
// in Kafka already. The digest keeps a marker that is not this outbox's
// (another outbox with the same TransactionalIDPrefix, or this outbox's
// database recreated while the marker lived on) from deleting rows that
// merely have the same ids.

// MarkerMaxBytesDefault is TransactionalConfig.MarkerMaxBytes' default: the
// broker's default offset.metadata.max.bytes.
const MarkerMaxBytesDefault = 4096

// markerMinBytes is the smallest MarkerMaxBytes: room for one id of any
// size and the largest header (version, digest, position and the last
// message's digest), encoded.
const markerMinBytes = 64

// The first byte of an encoded marker is its version, which is also its
// form. The publisher writes markerList for ascending ids of a batch
// without positions (table mode: the relay reads a batch ORDER BY id)
// that fit, markerSpan for those that do not, markerPositioned for a batch
// whose last message has a position (WAL mode), and markerList2 for any
// other. Every version is read.
const (
	// markerList2: the ids as zigzag varint differences, any order.
	markerList2 = 2
	// markerPositioned: as markerList2, after the header the position of
	// the batch's last message and the digest of that message alone.
	markerPositioned = 3
	// markerList: the first id as a zigzag varint, then each following
	// id's difference from the one before as an unsigned varint (ids
	// strictly ascending, every difference at least 1).
	markerList = 4
	// markerSpan: the first id as a zigzag varint, then the last id's
	// difference from it and the count of ids, unsigned varints.
	markerSpan = 5
)

// markerHeader is the version byte and the eight-byte digest;
// markerHeaderPositioned adds the eight-byte position and the eight-byte
// digest of the last message.
const (
	markerHeader           = 1 + 8
	markerHeaderPositioned = markerHeader + 8 + 8
)

// ErrBadMarker is wrapped by the error of a producer that found, in its
// bucket's progress group, a committed offset whose metadata is not a
// progress marker: another application commits offsets in a group whose
// name starts with TransactionalIDPrefix. The bucket is not published
// until that is resolved; the error is a *relay.MisconfigurationError.
var ErrBadMarker = errors.New("publisher: the progress group holds metadata that is not a progress marker")

// markerSums is what a marker holds of its batch's first n messages
// besides their ids: the digest of their message ids
// (relay.MessagesDigest), and, for a positioned marker, the position of
// the n-th message and the digest of its message id alone.
type markerSums struct {
	digest, position, last uint64
}

// encodeMarker encodes the marker of a batch without positions; see
// encodeMarkerSums.
func encodeMarker(ids []int64, limit int, digest func(n int) uint64) (string, int) {
	return encodeMarkerSums(ids, limit, false, func(n int) markerSums { return markerSums{digest: digest(n)} })
}

// encodeMarkerSums encodes the progress marker of a batch whose row ids
// are ids, within limit bytes of metadata, and returns the metadata and
// how many leading ids it covers; sums(n) is what the marker records of
// the first n ids' messages. The encoding is base64 (standard alphabet,
// no padding) of the version byte, the digest (eight bytes, big-endian),
// when positioned the position and the last message's digest (eight
// bytes each, big-endian), and the form's body.
//
// Ids strictly ascending of a batch without positions (the relay's table
// mode) are listed if the list fits, a byte per id within 127 of the one
// before, two within 16383 (markerList): the relay then deletes exactly
// those rows. Otherwise the marker holds their span (first, last, count;
// markerSpan), at most 46 bytes whatever the batch's size, and covers
// every id: the relay then deletes the rows of the span only if they are
// exactly count rows with that digest (relay.Committed). Ids in any other
// order, and a positioned batch (WAL mode, whose reader needs the ids),
// are listed as zigzag differences as far as they fit (markerList2,
// markerPositioned), and the caller publishes only those.
func encodeMarkerSums(ids []int64, limit int, positioned bool, sums func(n int) markerSums) (string, int) {
	maxRaw := limit * 3 / 4 // base64 of k bytes takes ceil(4k/3) characters
	if positioned || len(ids) == 0 || !ascending(ids) {
		return encodeZigzag(ids, maxRaw, positioned, sums)
	}
	raw := make([]byte, markerHeader, min(maxRaw, markerHeader+binary.MaxVarintLen64+len(ids)*2))
	raw[0] = markerList
	raw = binary.AppendVarint(raw, ids[0])
	for i := 1; i < len(ids) && len(raw) <= maxRaw; i++ {
		raw = binary.AppendUvarint(raw, uint64(ids[i]-ids[i-1]))
	}
	if len(raw) > maxRaw {
		raw = raw[:markerHeader]
		raw[0] = markerSpan
		raw = binary.AppendVarint(raw, ids[0])
		raw = binary.AppendUvarint(raw, uint64(ids[len(ids)-1]-ids[0]))
		raw = binary.AppendUvarint(raw, uint64(len(ids)))
	}
	binary.BigEndian.PutUint64(raw[1:markerHeader], sums(len(ids)).digest)
	return base64.RawStdEncoding.EncodeToString(raw), len(ids)
}

// ascending reports whether ids are strictly ascending.
func ascending(ids []int64) bool {
	for i := 1; i < len(ids); i++ {
		if ids[i] <= ids[i-1] {
			return false
		}
	}
	return true
}

// encodeZigzag lists as many leading ids as fit in maxRaw bytes (before
// base64) as a markerList2, or a markerPositioned when positioned.
func encodeZigzag(ids []int64, maxRaw int, positioned bool, sums func(n int) markerSums) (string, int) {
	header, version := markerHeader, byte(markerList2)
	if positioned {
		header, version = markerHeaderPositioned, markerPositioned
	}
	raw := make([]byte, header, min(maxRaw, header+len(ids)*2))
	raw[0] = version
	var (
		prev int64
		tmp  [binary.MaxVarintLen64]byte
		n    int
	)
	for i, id := range ids {
		d := id
		if i > 0 {
			d = id - prev
		}
		w := binary.PutVarint(tmp[:], d)
		if len(raw)+w > maxRaw {
			break
		}
		raw = append(raw, tmp[:w]...)
		prev = id
		n++
	}
	sum := sums(n)
	binary.BigEndian.PutUint64(raw[1:markerHeader], sum.digest)
	if positioned {
		binary.BigEndian.PutUint64(raw[markerHeader:markerHeader+8], sum.position)
		binary.BigEndian.PutUint64(raw[markerHeader+8:markerHeaderPositioned], sum.last)
	}
	return base64.RawStdEncoding.EncodeToString(raw), n
}

// decodeMarker decodes a marker of any version into the record the relay
// reconciles with.
func decodeMarker(s string) (relay.Committed, error) {
	raw, err := base64.RawStdEncoding.DecodeString(s)
	if err != nil {
		return relay.Committed{}, fmt.Errorf("%w: %v", ErrBadMarker, err)
	}
	if len(raw) < markerHeader {
		return relay.Committed{}, fmt.Errorf("%w: shorter than its header", ErrBadMarker)
	}
	c := relay.Committed{Digest: binary.BigEndian.Uint64(raw[1:markerHeader])}
	version, body := raw[0], raw[markerHeader:]
	bad := func(what string) (relay.Committed, error) {
		return relay.Committed{}, fmt.Errorf("%w: version %d: %s", ErrBadMarker, version, what)
	}
	switch version {
	case markerList2, markerPositioned:
		if version == markerPositioned {
			if len(raw) < markerHeaderPositioned {
				return bad("shorter than its header")
			}
			c.Position = binary.BigEndian.Uint64(raw[markerHeader : markerHeader+8])
			c.LastDigest = binary.BigEndian.Uint64(raw[markerHeader+8 : markerHeaderPositioned])
			body = raw[markerHeaderPositioned:]
		}
		var prev int64
		for len(body) > 0 {
			d, w := binary.Varint(body)
			if w <= 0 {
				return bad(fmt.Sprintf("truncated id %d", len(c.IDs)))
			}
			body = body[w:]
			if len(c.IDs) > 0 {
				d += prev
			}
			c.IDs = append(c.IDs, d)
			prev = d
		}
	case markerList:
		first, w := binary.Varint(body)
		if w <= 0 {
			return bad("no first id")
		}
		body = body[w:]
		c.IDs = append(c.IDs, first)
		for len(body) > 0 {
			d, w := binary.Uvarint(body)
			prev := c.IDs[len(c.IDs)-1]
			if w <= 0 || d == 0 || d > uint64(math.MaxInt64-prev) {
				return bad(fmt.Sprintf("bad id %d", len(c.IDs)))
			}
			body = body[w:]
			c.IDs = append(c.IDs, prev+int64(d))
		}
	case markerSpan:
		first, w := binary.Varint(body)
		if w <= 0 {
			return bad("no first id")
		}
		body = body[w:]
		width, w := binary.Uvarint(body)
		if w <= 0 || width > uint64(math.MaxInt64-first) {
			return bad("bad last id")
		}
		body = body[w:]
		count, w := binary.Uvarint(body)
		if w <= 0 || count == 0 || count-1 > width || count > math.MaxInt32 || w != len(body) {
			return bad("bad count")
		}
		c.First, c.Last, c.Count = first, first+int64(width), int(count)
	default:
		return relay.Committed{}, fmt.Errorf("%w: unknown version %d", ErrBadMarker, version)
	}
	return c, nil
}

// parseMarker decodes a marker of any version; its seq is left 0.
func parseMarker(s string) (marker, error) {
	rec, err := decodeMarker(s)
	return marker{rec: rec}, err
}

// ProgressGroup returns the consumer group whose committed offset records
// what bucket's last transaction carried: TransactionalIDPrefix, then
// "progress-", then the bucket number in decimal. The principal needs
// READ on it (a PREFIXED group ACL on TransactionalIDPrefix covers every
// bucket), and READ on the topics the outbox publishes to.
func (t *Transactional) ProgressGroup(bucket int) string {
	return t.cfg.TransactionalIDPrefix + "progress-" + strconv.Itoa(bucket)
}

// marker is what a bucket's progress group holds: the sequence number of
// its last committed transaction (0 for none) and the record of the rows
// it carried.
type marker struct {
	seq int64
	rec relay.Committed
}

// readMarker reads bucket's marker from its progress group with a stable
// OffsetFetch, retrying while the broker reports a transactional commit
// still being written or the coordinator moving, as often and with the
// backoff of the producer's Transaction.Retry.
func (t *Transactional) readMarker(client sarama.Client, group string) (marker, error) {
	sc := client.Config()
	retry := sc.Producer.Transaction.Retry
	var last error
	for attempt := 0; attempt <= retry.Max; attempt++ {
		if attempt > 0 {
			d := retry.Backoff
			if retry.BackoffFunc != nil {
				d = retry.BackoffFunc(attempt-1, retry.Max)
			}
			time.Sleep(d)
		}
		m, again, err := t.fetchMarker(client, group)
		if !again {
			return m, err
		}
		last = err
	}
	return marker{}, fmt.Errorf("publisher: read progress group %q: %w", group, last)
}

// fetchMarker is one attempt of readMarker; again reports a retriable
// failure.
func (t *Transactional) fetchMarker(client sarama.Client, group string) (m marker, again bool, err error) {
	coord, err := client.Coordinator(group)
	if err != nil {
		_ = client.RefreshCoordinator(group)
		return marker{}, true, err
	}
	req := sarama.NewOffsetFetchRequest(client.Config().Version, group, nil)
	req.RequireStable = true
	resp, err := coord.FetchOffset(req)
	if err != nil {
		_ = coord.Close()
		_ = client.RefreshCoordinator(group)
		return marker{}, true, err
	}
	blocks, kerr := resp.Blocks, resp.Err
	if g := resp.GetGroup(group); g != nil {
		blocks, kerr = g.Blocks, g.Err
	}
	if kerr == sarama.ErrNoError {
		for _, parts := range blocks {
			for _, b := range parts {
				if b.Err != sarama.ErrNoError {
					kerr = b.Err
				}
			}
		}
	}
	switch {
	case kerr == sarama.ErrGroupIDNotFound:
		return marker{}, false, nil // never committed: nothing to reconcile
	case kerr == sarama.ErrNoError:
	case kerr == sarama.ErrGroupAuthorizationFailed || kerr == sarama.ErrTopicAuthorizationFailed:
		return marker{}, false, &relay.MisconfigurationError{Setting: "TransactionalIDPrefix",
			Reason: "the broker refuses to read the bucket's progress group; grant READ on the group " + group +
				" (a PREFIXED group ACL on the prefix) and on the outbox's topics",
			Err: fmt.Errorf("publisher: read progress group %q: %w", group, kerr)}
	case kerr == sarama.ErrNotCoordinatorForConsumer || kerr == sarama.ErrConsumerCoordinatorNotAvailable:
		_ = client.RefreshCoordinator(group)
		return marker{}, true, kerr
	case kerr == sarama.ErrUnstableOffsetCommit || kerr == sarama.ErrOffsetsLoadInProgress || kerr == sarama.ErrRequestTimedOut:
		return marker{}, true, kerr
	default:
		return marker{}, false, fmt.Errorf("publisher: read progress group %q: %w", group, kerr)
	}
	var best *sarama.OffsetFetchResponseBlock
	for _, parts := range blocks {
		for _, b := range parts {
			if b.Offset > 0 && (best == nil || b.Offset > best.Offset) {
				best = b
			}
		}
	}
	if best == nil {
		return marker{}, false, nil // never committed (or expired): nothing to reconcile
	}
	m, err = parseMarker(best.Metadata)
	if err != nil {
		return marker{}, false, &relay.MisconfigurationError{Setting: "TransactionalIDPrefix",
			Reason: "the group " + group + " is used by something else than this outbox's relays; choose a prefix no other application's groups start with",
			Err:    err}
	}
	m.seq = best.Offset
	return m, false, nil
}

var _ relay.Reconciler = (*Transactional)(nil)

// Reconcile implements relay.Reconciler: it returns the row ids that the
// last transaction committed for lease's bucket carried, and the digest
// of their message ids (with, for a batch of positioned messages, the
// last one's position and digest: relay.Committed), which the relay deletes before it reads the
// bucket if the store's rows of those ids hold those messages. It waits
// for the bucket's producer (starting it if needed: its InitProducerID
// fences the previous owner and ends its open transaction, and its start
// reads the marker the last committed transaction left, see
// ProgressGroup) and for a transaction in progress on it. The ids may name
// rows deleted long ago; the relay ignores those.
func (t *Transactional) Reconcile(ctx context.Context, lease relay.Lease) (relay.Committed, error) {
	t.mu.Lock()
	started := t.started
	t.mu.Unlock()
	if !started {
		return relay.Committed{}, errTransactionalNotStarted
	}
	p, err := t.acquire(ctx, lease.Bucket)
	if err != nil {
		return relay.Committed{}, err
	}
	c := p.last.rec
	<-p.sem
	t.bg.Done()
	return c, nil
}
