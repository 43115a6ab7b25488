package wire

import "hash/fnv"

// Bucket returns the ordering bucket of a message with this key and
// partition among bucketCount buckets. The function is part of the storage
// format: every writer and relay sharing a table must agree on it, so it
// never changes between versions.
//
//   - a pinned partition p: p mod bucketCount;
//   - a key (including the empty key): FNV-1a 32-bit of the key bytes, mod
//     bucketCount;
//   - keyless (nil key): FNV-1a 32-bit of the message id, mod bucketCount, so
//     keyless messages spread over every bucket.
func Bucket(key []byte, partition *int32, messageID string, bucketCount int) int {
	if bucketCount <= 0 {
		return 0
	}
	if partition != nil {
		return int(uint32(*partition) % uint32(bucketCount))
	}
	h := fnv.New32a()
	if key != nil {
		h.Write(key)
	} else {
		h.Write([]byte(messageID))
	}
	return int(h.Sum32() % uint32(bucketCount))
}
